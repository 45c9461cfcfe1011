"""`sglang-dlite serve`: a thin wrapper around ``python -m sglang.launch_server`` that fills in the
default target (the bundled SmolLM2-135M-Instruct), the default DLite drafter (the shipped
checkpoint) and ``--speculative-algorithm DLITE``. Every other argument goes to sglang unchanged::

    sglang-dlite serve                                   # defaults, CUDA server on :30000
    sglang-dlite serve --model-path T --draft D -- --port 8000 --mem-fraction-static 0.8
    sglang-dlite serve --cpu -- --port 8000              # this project's CPU test stack
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default="default", help="target HF checkpoint folder ('default': bundled SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="DLite checkpoint folder (default: the shipped drafter)")
    p.add_argument("--no-spec", action="store_true", help="serve the target without speculation (baseline)")
    p.add_argument("--cpu", action="store_true",
                   help="run on this project's CPU stack (torch_native attention, fp32, test-only stand-ins)")
    p.add_argument("--dry-run", action="store_true", help="print the sglang command and exit")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="arguments passed to sglang.launch_server (after --)")


def check_plugin_enabled(environ=None) -> None:
    """sglang loads only the plugins named in SGLANG_PLUGINS (when set): DLITE needs 'dlite'."""
    from ..errors import DLiteConfigError

    allowed = (environ if environ is not None else os.environ).get("SGLANG_PLUGINS")
    if allowed:
        names = {x.strip() for x in allowed.split(",") if x.strip()}
        if "dlite" not in names:
            raise DLiteConfigError(
                f"SGLANG_PLUGINS={allowed!r} does not enable the 'dlite' plugin, so sglang would not "
                "know --speculative-algorithm DLITE (nor the DLite checkpoint format). Unset "
                "SGLANG_PLUGINS or add 'dlite' to it."
            )


def build_command(args) -> tuple[list, dict]:
    from ..drafters import shipped_drafter_path
    from ..errors import DLiteInputError
    from ..target import resolve_target

    target = resolve_target(args.model_path)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", target]
    env = dict(os.environ)
    if not args.no_spec:
        draft = args.draft or shipped_drafter_path()
        if draft is None:
            raise DLiteInputError(
                "no DLite drafter: the shipped checkpoint (sglang_dlite/checkpoints/dlite-smollm2-135m/"
                "model.safetensors) is missing from this install. Pass --draft PATH (a DLite checkpoint "
                "folder), reinstall the package, or use --no-spec."
            )
        check_plugin_enabled()
        cmd += ["--speculative-algorithm", "DLITE", "--speculative-draft-model-path", draft]
    if args.cpu:
        from ..cpu_launch import SERVER_CPU_ARGS, cpu_environ

        env.update(cpu_environ())
        cmd += SERVER_CPU_ARGS
    extra = list(args.sglang_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return cmd + extra, env


def run(args) -> int:
    cmd, env = build_command(args)
    print(" ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env)
