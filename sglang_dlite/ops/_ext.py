"""Finds and loads the compiled draft-step ops (built by ``python -m sglang_dlite.ops.build``).

The library registers ``torch.ops.sglang_dlite.*`` (CPU kernels always, CUDA kernels when it was
built with a CUDA torch). Nothing here is required: without the library the dispatcher uses the
torch reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_dlite.ops import fake

LIB_NAME = "sglang_dlite_ops"
OPS = ("assemble_round_inputs", "round_attention", "lowrank_rnn_scan", "lm_head_argmax")
BUILD_HINT = "build it with `make build-ext` (or `python -m sglang_dlite.ops.build`)"

_state: dict = {"tried": False, "path": None, "error": None, "ok": False, "cuda": None, "ops": {}}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def build_dir() -> Path:
    """Where the builder writes the library: <repo>/build/ext."""
    return repo_root() / "build" / "ext"


def lib_path() -> Path:
    return build_dir() / f"{LIB_NAME}.so"


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("sglang_dlite::lowrank_rnn_scan", "CPU")
    except Exception:  # pragma: no cover - private API moved
        return hasattr(torch.ops.sglang_dlite, "lowrank_rnn_scan")


def load() -> bool:
    """Load the library once (if built). Returns whether the CPU ops are available (cached: the
    dispatcher asks on every call, also while torch.compile traces it)."""
    if _state["tried"]:
        return _state["ok"]
    _state["tried"] = True
    path = lib_path()
    if _registered():  # already loaded (e.g. by the builder in this process)
        _state["path"] = str(path)
    elif path.is_file():
        try:
            torch.ops.load_library(str(path))
            _state["path"] = str(path)
        except Exception as exc:  # a stale build against another torch, a bad file, ...
            _state["error"] = f"{path} failed to load: {exc}"
    else:
        _state["error"] = f"{path} is missing"
    ok = _state["ok"] = _state["path"] is not None and _registered()
    if ok:
        fake.register()
    return ok


def reset() -> None:
    """Forget the load attempt (the builder calls this after building)."""
    _state.update(tried=False, path=None, error=None, ok=False, cuda=None, ops={})


def has_cpu() -> bool:
    return load()


def has_op(name: str) -> bool:
    """Whether the loaded library has a CPU kernel for ``name`` (a library built from older
    sources lacks the newer ops until ``make build-ext`` runs again). Cached: the engine asks on
    every layer of every step."""
    if not load():
        return False
    known = _state["ops"]
    if name not in known:
        try:
            known[name] = torch._C._dispatch_has_kernel_for_dispatch_key(f"sglang_dlite::{name}", "CPU")
        except Exception:  # pragma: no cover - private API moved
            known[name] = hasattr(torch.ops.sglang_dlite, name)
    return known[name]


def has_cuda() -> bool:
    if _state["cuda"] is None:
        _state["cuda"] = False
        if load() and torch.cuda.is_available():
            try:
                _state["cuda"] = torch._C._dispatch_has_kernel_for_dispatch_key("sglang_dlite::lowrank_rnn_scan", "CUDA")
            except Exception:  # pragma: no cover
                pass
    return _state["cuda"]


def status() -> str:
    """One line for logs and benchmark reports."""
    if not load():
        return f"torch reference only: {_state['error']}; {BUILD_HINT}"
    return f"compiled ops loaded from {_state['path']} (CPU: yes, CUDA: {'yes' if has_cuda() else 'no'})"


def unavailable_reason() -> str:
    load()
    return _state["error"] or "not loaded"
