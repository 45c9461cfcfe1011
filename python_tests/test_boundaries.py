"""Architecture boundaries that the code review of issue 16 asked for, checked on the source.

- The package never imports the tests and never edits ``sys.path`` (the CPU launch environment is
  the package's own ``sglang_dlite.cpu_launch``).
- Pure-torch model code (config, model, ops, engine, drafters, lookup) imports no sglang.
- ``sglang-dlite serve --cpu`` gets its environment from ``cpu_launch``.
"""

from __future__ import annotations

import ast
import argparse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "sglang_dlite"
PURE_TORCH = ["config.py", "model.py", "engine.py", "drafters.py", "ops", "lookup", "spec"]


def _py_files(*roots):
    for r in roots:
        p = PKG / r if not Path(r).is_absolute() else Path(r)
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from sorted(p.rglob("*.py"))


def _imports(path: Path) -> set:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_package_does_not_import_tests_or_edit_sys_path():
    """Only cpu_launch may put a folder on sys.path: the CPU stand-ins, for the engine's own process."""
    bad = []
    for f in _py_files(PKG):
        text = f.read_text()
        if "sglang_fixtures" in _imports(f):
            bad.append(f"{f.relative_to(REPO)}: imports the tests")
        if ("sys.path.insert" in text or "sys.path.append" in text) and f.name != "cpu_launch.py":
            bad.append(f"{f.relative_to(REPO)}: edits sys.path")
    assert not bad, bad


def test_pure_torch_modules_import_no_sglang():
    bad = [f"{f.relative_to(REPO)}: {sorted(m for m in _imports(f) if m.split('.')[0] == 'sglang')}"
           for f in _py_files(*PURE_TORCH) if any(m.split(".")[0] == "sglang" for m in _imports(f))]
    assert not bad, bad


def test_serve_cpu_uses_the_cpu_launch_environment(tmp_path):
    from sglang_dlite import cpu_launch
    from sglang_dlite.sglang_plugin import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model-path", str(tmp_path), "--no-spec", "--cpu", "--dry-run"])
    cmd, env = serve.build_command(args)
    assert env["PYTHONPATH"].split(":")[0] == str(cpu_launch.CPU_STANDINS)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert cmd[-len(cpu_launch.SERVER_CPU_ARGS):] == cpu_launch.SERVER_CPU_ARGS


def test_missing_standins_say_what_to_do(monkeypatch, tmp_path):
    from sglang_dlite import cpu_launch
    from sglang_dlite.errors import MissingDependencyError

    monkeypatch.setattr(cpu_launch, "CPU_STANDINS", tmp_path / "nowhere")
    with pytest.raises(MissingDependencyError, match="source checkout"):
        cpu_launch.cpu_environ()
