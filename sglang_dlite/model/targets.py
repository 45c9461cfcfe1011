"""Which targets a DLite drafter (or a baseline drafter) can be built for, and what a drafter
reads from a target's HF config: ``target_info`` (the architecture check and the target's shape).
The derivation of a drafter config from it is ``DrafterConfig.for_target`` (drafter_config.py),
with DLite's own fields in ``DLiteConfig`` (``config.drafter_config_for_target``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from transformers import AutoConfig

from sglang_dlite.errors import DLiteConfigError


# Architectures every part of the pipeline handles: HF capture (``model.model.layers`` outputs and
# ``model.model.norm``) for gen-data, training features and the reference engine, and sglang's
# DLITE worker (the sglang model sets its aux hidden-state capture layers; attention-only, so a
# rejected draft leaves no recurrent state behind). Tested end to end on tiny random Llama and
# Qwen3 targets (python_tests/model/test_any_target.py); Qwen2 / Mistral share those code paths.
SUPPORTED_TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def supported_targets_text() -> str:
    return ", ".join(SUPPORTED_TARGET_ARCHITECTURES)


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter needs to know about its target, read from the target's HF config. The width
    fields are None only for a stub config that lacks them (a real HF config has them all)."""

    architecture: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None


def _hf_config(target):
    """A transformers config from a checkpoint folder, a config, a model or a config dict."""
    if isinstance(target, (str, os.PathLike)):
        path = os.fspath(target)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise DLiteConfigError(f"target {path!r} is not a HF checkpoint folder (no config.json).")
        try:
            return AutoConfig.from_pretrained(path)
        except (ValueError, KeyError, OSError) as exc:
            raise DLiteConfigError(
                f"transformers cannot read the target config {path!r} ({exc}); supported target "
                f"architectures: {supported_targets_text()}."
            ) from exc
    if isinstance(target, dict):
        return SimpleNamespace(**target)
    return getattr(target, "config", target) if not hasattr(target, "hidden_size") else target


def target_info(target) -> TargetInfo:
    """Read and check a target: a HF checkpoint folder, config, model or config dict. Raises a
    DLiteConfigError naming the supported architectures for any other architecture."""
    cfg = _hf_config(target)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    archs = list(getattr(cfg, "architectures", None) or getattr(text, "architectures", None) or [])
    mtype = str(getattr(text, "model_type", "") or "")
    known = [a for a in archs if a in SUPPORTED_TARGET_ARCHITECTURES]
    if known:
        arch = known[0]
    elif not archs and mtype in SUPPORTED_TARGET_ARCHITECTURES.values():
        arch = next(a for a, t in SUPPORTED_TARGET_ARCHITECTURES.items() if t == mtype)
    else:
        what = "/".join(archs) if archs else (f"model_type {mtype!r}" if mtype else "an unknown architecture")
        raise DLiteConfigError(
            f"unsupported target architecture {what}: DLite drafters are built, trained and served "
            f"for {supported_targets_text()} (dense, attention-only decoders whose layer outputs both "
            "transformers and sglang's DLITE worker capture). Use one of these, or serve this model "
            "without --speculative-algorithm DLITE."
        )
    try:
        H, V, N = int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers)
        nh = getattr(text, "num_attention_heads", None)
        nh = int(nh) if nh else None
        kvh = int(getattr(text, "num_key_value_heads", None) or nh) if nh else None
        hd = int(getattr(text, "head_dim", None) or H // nh) if nh else None
        inter = getattr(text, "intermediate_size", None)
        inter = int(inter) if inter else None
    except (AttributeError, TypeError, ValueError) as exc:
        raise DLiteConfigError(f"the {arch} target config lacks a field a drafter is sized from ({exc}).") from exc
    if N < 2:
        raise DLiteConfigError(
            f"the target has {N} decoder layer(s): DLite reads a layer's output below the last one, "
            "so it needs a target with at least 2 layers."
        )
    return TargetInfo(arch, mtype or SUPPORTED_TARGET_ARCHITECTURES[arch], H, V, N, nh, kvh, hd, inter)
