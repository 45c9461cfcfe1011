"""The DLITE plugin without a running engine: registration, the version guard, the conformance of
DLiteSpecAlgo with sglang's algorithm enum, and start-up validation of bad configurations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

import sglang_fixtures as F

F.activate_cpu_standins()


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("dlite") == "sglang_dlite.serving:register"


def test_register_is_idempotent_and_registers_dlite():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dlite.serving import register
    from sglang_dlite.serving.algorithm import DLiteSpecAlgo

    register()
    register()
    algo = SpeculativeAlgorithm.from_string("dlite")
    assert isinstance(algo, DLiteSpecAlgo) and algo.name == "DLITE" and algo.supports_overlap
    assert not algo.has_draft_kv() and not algo.need_topk() and not algo.carries_draft_hidden_states()
    from transformers import AutoConfig

    from sglang_dlite.model.config import DLiteConfig

    assert AutoConfig.for_model("dlite").__class__ is DLiteConfig


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "1.0.0"])
def test_register_rejects_unsupported_sglang(monkeypatch, version):
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving import SUPPORTED_SGLANG, register, versions

    monkeypatch.setattr(versions, "installed_sglang_version", lambda: version)
    with pytest.raises(DLiteConfigError) as exc:
        register()
    msg = str(exc.value)
    assert version in msg and SUPPORTED_SGLANG in msg and "Install a supported release" in msg


def test_supported_range_accepts_installed_and_patch_builds():
    from sglang_dlite.serving.versions import check_sglang_version

    assert check_sglang_version() == check_sglang_version()
    for ok in ("0.5.23", "0.5.23.post1", "0.5.23+cu129"):
        check_sglang_version(ok)


def test_conformance_with_sglang_algorithm_enum():
    """Fails when sglang adds a method to SpeculativeAlgorithm that DLiteSpecAlgo lacks (the
    scheduler duck-types plugin algorithms against the enum)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dlite.serving.algorithm import DLiteSpecAlgo

    enum_methods = {
        name for name, value in vars(SpeculativeAlgorithm).items()
        if not name.startswith("_") and callable(value) and not isinstance(value, (classmethod, staticmethod))
        and name not in SpeculativeAlgorithm.__members__
    }
    assert "carries_draft_hidden_states" in enum_methods  # the guard really sees the enum
    missing = sorted(n for n in enum_methods if not callable(getattr(DLiteSpecAlgo, n, None)))
    assert not missing, f"DLiteSpecAlgo lacks SpeculativeAlgorithm methods: {missing}"


# ------------------------------------------------------------------ start-up validation
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin_cfg")
    target = F.save_tiny_llama(d / "target")
    drafter = F.save_random_dlite(d / "drafter", target)
    return d, target, drafter


def _args(target, drafter, **kw):
    a = dict(model_path=target, speculative_draft_model_path=drafter, speculative_num_draft_tokens=None,
             speculative_num_steps=None, speculative_eagle_topk=None, tp_size=1)
    a.update(kw)
    return types.SimpleNamespace(**a)


def _validate(args):
    from sglang_dlite.serving.algorithm import validate_server_args

    validate_server_args(args)


def test_validate_accepts_matching_drafter(tiny):
    _, target, drafter = tiny
    _validate(_args(target, drafter))
    _validate(_args(target, drafter, speculative_num_draft_tokens=5, speculative_num_steps=4))
    _validate(_args(target, drafter, speculative_num_draft_tokens=3))  # verify a prefix of the chain
    _validate(_args(target, drafter, speculative_num_draft_tokens=2, speculative_num_steps=1))


@pytest.mark.parametrize("field,value,needle", [
    ("target_hidden_size", 128, "hidden size"),
    ("vocab_size", 200, "vocabulary"),
    ("target_num_layers", 40, "layer ids"),
])
def test_drafter_for_another_target_fails(tiny, field, value, needle):
    from sglang_dlite.errors import DLiteConfigError

    d, target, _ = tiny
    over = {field: value}
    if field == "target_num_layers":
        over["target_layer_ids"] = [20, 30]
    other = F.save_random_dlite(d / f"other_{field}", target, **over)
    with pytest.raises(DLiteConfigError, match=needle):
        _validate(_args(target, other))


def test_k_inconsistent_with_num_draft_tokens_fails(tiny, monkeypatch):
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving.algorithm import HYBRID_MAX_DRAFT_TOKENS as W_MAX

    _, target, drafter = tiny  # K = 4
    # hybrid drafting (the default): the lookup may continue a chain past DLite's K drafts
    monkeypatch.delenv("SGLANG_DLITE_CONFIG", raising=False)
    _validate(_args(target, drafter, speculative_num_draft_tokens=12))
    with pytest.raises(DLiteConfigError, match=rf"--speculative-num-draft-tokens {W_MAX + 1} .*K=4.*between 2 and {W_MAX}"):
        _validate(_args(target, drafter, speculative_num_draft_tokens=W_MAX + 1))
    with pytest.raises(DLiteConfigError, match=rf"--speculative-num-draft-tokens 1 .*between 2 and {W_MAX}"):
        _validate(_args(target, drafter, speculative_num_draft_tokens=1))
    # DLite alone: at most K + 1
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"lookup": false}')
    with pytest.raises(DLiteConfigError, match=r"--speculative-num-draft-tokens 8 .*K=4.*between 2 and 5.*the setting lookup: true"):
        _validate(_args(target, drafter, speculative_num_draft_tokens=8))
    with pytest.raises(DLiteConfigError, match=r"--speculative-num-draft-tokens 1 .*between 2 and 5"):
        _validate(_args(target, drafter, speculative_num_draft_tokens=1))
    with pytest.raises(DLiteConfigError, match="--speculative-num-steps 2 .*pass 4"):
        _validate(_args(target, drafter, speculative_num_steps=2))
    with pytest.raises(DLiteConfigError, match="--speculative-num-steps 4 .*pass 2"):
        _validate(_args(target, drafter, speculative_num_draft_tokens=3, speculative_num_steps=4))
    with pytest.raises(DLiteConfigError, match="chain"):
        _validate(_args(target, drafter, speculative_eagle_topk=4))


def test_default_num_draft_tokens(tiny, monkeypatch):
    """Unset --speculative-num-draft-tokens: 16 on a CPU with hybrid drafting and the per-round
    width; K + 1 on a GPU, with the lookup off, with a fixed width, or under TP; and what
    handle_server_args writes back (steps = W - 1, top-k 1)."""
    from sglang_dlite.serving.algorithm import CPU_HYBRID_DRAFT_TOKENS, DLiteSpecAlgo, default_num_draft_tokens

    _, target, drafter = tiny  # K = 4
    monkeypatch.delenv("SGLANG_DLITE_CONFIG", raising=False)
    cpu = _args(target, drafter, device="cpu", disable_cuda_graph=False)
    assert default_num_draft_tokens(4, cpu) == CPU_HYBRID_DRAFT_TOKENS == 16
    assert default_num_draft_tokens(4, _args(target, drafter, device="cuda")) == 5
    assert default_num_draft_tokens(4, _args(target, drafter, device="cpu", tp_size=2)) == 5
    assert default_num_draft_tokens(20, cpu) == 21  # never below K + 1
    algo = DLiteSpecAlgo.__new__(DLiteSpecAlgo)
    algo.handle_server_args(cpu)
    assert (cpu.speculative_num_draft_tokens, cpu.speculative_num_steps, cpu.speculative_eagle_topk) == (16, 15, 1)
    _validate(cpu)
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"verify_width": "fixed"}')
    assert default_num_draft_tokens(4, cpu) == 5
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"lookup": false}')
    assert default_num_draft_tokens(4, cpu) == 5


@pytest.mark.parametrize("device, setting, before, after", [
    ("cpu", None, False, True),     # a CPU: sglang's non-overlap scheduler, as for its own algorithms
    ("cpu", True, False, False),    # the setting cpu_overlap keeps the overlap scheduler (its tests)
    ("cpu", None, True, True),      # already off: stays off
    ("cuda", None, False, False),   # a GPU overlaps for real: untouched
])
def test_cpu_device_runs_the_non_overlap_scheduler(tiny, monkeypatch, device, setting, before, after):
    _, target, drafter = tiny
    monkeypatch.delenv("SGLANG_DLITE_CONFIG", raising=False)
    if setting is not None:
        monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"cpu_overlap": setting}))
    args = _args(target, drafter, device=device, disable_overlap_schedule=before)
    _validate(args)
    assert args.disable_overlap_schedule is after


def test_missing_or_corrupt_draft_path_fails(tiny):
    from sglang_dlite.errors import DLiteConfigError

    d, target, drafter = tiny
    with pytest.raises(DLiteConfigError, match="needs --speculative-draft-model-path"):
        _validate(_args(target, None))
    with pytest.raises(DLiteConfigError, match="not a drafter checkpoint folder"):
        _validate(_args(target, str(d / "nowhere")))
    bad_json = d / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(DLiteConfigError, match="not valid JSON"):
        _validate(_args(target, str(bad_json)))
    bad_w = d / "bad_weights"
    bad_w.mkdir()
    (bad_w / "config.json").write_text(open(os.path.join(drafter, "config.json")).read())
    (bad_w / "model.safetensors").write_bytes(b"\x00garbage" * 8)
    with pytest.raises(DLiteConfigError, match="not a readable safetensors"):
        _validate(_args(target, str(bad_w)))
    not_dlite = d / "not_dlite"
    not_dlite.mkdir()
    cfg = json.load(open(os.path.join(drafter, "config.json")))
    cfg["model_type"] = "llama"
    (not_dlite / "config.json").write_text(json.dumps(cfg))
    (not_dlite / "model.safetensors").write_bytes(open(os.path.join(drafter, "model.safetensors"), "rb").read())
    with pytest.raises(DLiteConfigError, match="not a DLite drafter"):
        _validate(_args(target, str(not_dlite)))


_ENGINE_SNIPPET = """
import sys
sys.path.insert(0, {tests!r})
import sglang_fixtures as F
if __name__ == "__main__":
    try:
        e = F.start_engine({target!r}, dlite={drafter!r}, skip_tokenizer_init=True, **{extra!r})
    except BaseException as exc:
        print("STARTUP-ERROR:", type(exc).__name__, exc)
        sys.exit(3)
    e.shutdown()
    print("STARTED")
"""


def _start_in_subprocess(target, drafter, env_extra=None, **extra):
    code = _ENGINE_SNIPPET.format(tests=str(F.REPO / "python_tests"), target=str(target),
                                  drafter=str(drafter), extra=extra)
    env = dict(os.environ, **F.cpu_environ(), **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)


def test_engine_startup_rejects_mismatched_drafter(tiny):
    """Through sgl.Engine: fails in the launcher (no scheduler started) with the clear message."""
    d, target, _ = tiny
    other = F.save_random_dlite(d / "engine_other", target, vocab_size=200)
    r = _start_in_subprocess(target, other)
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    assert "does not match the target model" in r.stdout and "vocabulary" in r.stdout


def test_engine_startup_with_plugins_disabled(tiny):
    """SGLANG_PLUGINS=none: sglang cannot even parse the DLite checkpoint (model type 'dlite'),
    so it fails at start-up, before any scheduler starts, naming the 'dlite' model type."""
    _, target, drafter = tiny
    r = _start_in_subprocess(target, drafter, env_extra={"SGLANG_PLUGINS": "none"})
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    assert "dlite" in r.stdout


def test_serve_wrapper_explains_disabled_plugin(tiny, monkeypatch):
    """`sglang-dlite serve` checks the whitelist itself and says what to change."""
    import argparse

    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving import serve

    _, target, drafter = tiny
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model-path", target, "--draft", drafter, "--dry-run"])
    assert serve.run(args) == 0
    cmd, _ = serve.build_command(args)
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DLITE"
    monkeypatch.setenv("SGLANG_PLUGINS", "none")
    with pytest.raises(DLiteConfigError, match="SGLANG_PLUGINS"):
        serve.build_command(args)


# The worker's accept rules (greedy prefix, sampled law with penalties) are tested in
# test_verify_logits.py.


def test_plugin_never_loads_the_cpu_standins():
    """In a process without the test environment (as on a CUDA deployment), registering the
    plugin loads none of cpu_support/sglang_cpu."""
    code = (
        "import sys\n"
        "from sglang_dlite.serving import register\n"
        "register()\n"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"
        "assert SpeculativeAlgorithm.from_string('DLITE').name == 'DLITE'\n"
        "bad = [m for m in ('dlite_cpu_verify_hook', 'sitecustomize') if m in sys.modules and "
        "'sglang_cpu' in (getattr(sys.modules[m], '__file__', '') or '')]\n"
        "sk = sys.modules.get('sgl_kernel')\n"
        "if sk is not None and getattr(sk, 'IS_DLITE_CPU_STANDIN', False): bad.append('sgl_kernel')\n"
        "print('LOADED', bad)\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240,
                       cwd=str(F.REPO.parent))
    assert "LOADED []" in r.stdout, r.stdout + r.stderr[-3000:]
