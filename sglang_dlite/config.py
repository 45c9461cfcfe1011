"""DLiteConfig: every shape and design choice of a DLite drafter, saved as config.json.

A transformers ``PretrainedConfig`` (``model_type="dlite"``) so that sglang, which parses every
draft-model path with ``AutoConfig``, can read a DLite checkpoint once the plugin registers it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from .drafter_config import MAX_BLOCK_SIZE, DrafterConfig  # noqa: F401  (MAX_BLOCK_SIZE: re-exported)
from .errors import DLiteConfigError

MAX_CONTEXT_POSITIONS = 64
BLOCK_ATTENTION_MODES = ("bidirectional", "causal")
HEAD_INPUTS = ("hidden", "token")


def parse_history(history: str) -> Optional[int]:
    """``"none"`` -> 0, ``"full"`` -> None (unbounded), ``"window:W"`` -> W."""
    if history == "none":
        return 0
    if history == "full":
        return None
    if isinstance(history, str) and history.startswith("window:"):
        try:
            w = int(history.split(":", 1)[1])
        except ValueError:
            w = -1
        if w > 0:
            return w
    raise DLiteConfigError(
        f"history={history!r} is not understood: use 'none' (DLite), 'full' (the history-aware "
        f"teacher) or 'window:W' with W > 0 (sliding-window ablation, e.g. 'window:128')."
    )


def default_layer_ids(num_target_layers: int) -> list[int]:
    """The proportional choice to layers 12 and 14 of a 36-layer target (DLITE.md), kept inside
    0..N-2: sglang never captures the last layer's output (it is the final hidden state)."""
    top = max(num_target_layers - 2, 0)
    a = min(max(round(12 * num_target_layers / 36), 0), top)
    b = min(max(round(14 * num_target_layers / 36), a + 1), top)
    return [a] if a == b else [a, b]


def low_mid_high_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high layers ``[2, N // 2, N - 3]`` (sglang's own EAGLE-3 default),
    clipped to 0..N-2 and de-duplicated for shallow targets. For the 30-layer SmolLM2 this is
    2, 15, 27: the shipped drafter's layers (they beat the proportional 10, 12 on held-out tau)."""
    top = max(num_target_layers - 2, 0)
    return sorted({min(max(i, 0), top) for i in (2, num_target_layers // 2, num_target_layers - 3)})


class DLiteConfig(DrafterConfig):
    """DLite's config: the drafter config base (target shape, capture layers, transformer shape and
    their checks, shared with the baselines) + DLite's context window, RNN head and history modes."""

    model_type = "dlite"
    display_name = "DLite"
    default_layer_ids = staticmethod(default_layer_ids)

    def __init__(
        self,
        num_context_positions: int = 4,
        num_layers: int = 2,
        rnn_rank: int = 72,
        block_attention: str = "bidirectional",
        history: str = "none",
        head_input: str = "hidden",
        draft_vocab_size: int = 0,
        **kwargs,
    ):
        """DLite's own fields; the shared ones (target shape, target_layer_ids, block_size, heads,
        head_dim, intermediate_size, rope_theta, rms_norm_eps, ...) go to ``DrafterConfig``."""
        self.num_context_positions = int(num_context_positions)
        self.rnn_rank = int(rnn_rank)
        self.block_attention = block_attention
        self.history = history
        self.head_input = head_input
        # >0: drafts are chosen among this many tokens (the ``draft_vocab`` buffer of the
        # checkpoint: the training data's most frequent ids); 0: the whole vocabulary.
        self.draft_vocab_size = int(draft_vocab_size)
        kwargs.setdefault("architectures", ["DLiteDrafter"])
        super().__init__(num_layers=num_layers, **kwargs)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        super().validate()
        bad = self.invalid
        if not 0 <= self.num_context_positions <= MAX_CONTEXT_POSITIONS:
            bad(
                f"num_context_positions={self.num_context_positions} must be in "
                f"[0, {MAX_CONTEXT_POSITIONS}] (a small window, independent of context length)."
            )
        if self.rnn_rank < 1:
            bad(f"rnn_rank={self.rnn_rank} must be >= 1.")
        if self.block_attention not in BLOCK_ATTENTION_MODES:
            bad(f"block_attention={self.block_attention!r}; choose one of {BLOCK_ATTENTION_MODES}.")
        if self.head_input not in HEAD_INPUTS:
            bad(f"head_input={self.head_input!r}; choose one of {HEAD_INPUTS}.")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            bad(f"draft_vocab_size={self.draft_vocab_size} must be in [0, vocab_size={self.vocab_size}] (0: no drafting vocabulary).")
        parse_history(self.history)

    @property
    def history_window(self) -> Optional[int]:
        """0 for DLite (no history), W for a window, None for the full-history teacher."""
        return parse_history(self.history)


# ---------------------------------------------------------------------------- any target
# Architectures every part of the pipeline handles: HF capture (``model.model.layers`` outputs and
# ``model.model.norm``) for gen-data, training features and the reference engine, and sglang's
# DLITE worker (the sglang model sets its aux hidden-state capture layers; attention-only, so a
# rejected draft leaves no recurrent state behind). Tested end to end on tiny random Llama and
# Qwen3 targets (python_tests/test_any_target.py); Qwen2 / Mistral share those code paths.
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
    """What a drafter needs to know about its target, read from the target's HF config."""

    architecture: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


def _hf_config(target):
    """A transformers config from a checkpoint folder, a config, a model or a config dict."""
    if isinstance(target, (str, os.PathLike)):
        path = os.fspath(target)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise DLiteConfigError(f"target {path!r} is not a HF checkpoint folder (no config.json).")
        from transformers import AutoConfig

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
        nh = int(text.num_attention_heads)
        kvh = int(getattr(text, "num_key_value_heads", None) or nh)
        hd = int(getattr(text, "head_dim", None) or H // nh)
        inter = int(text.intermediate_size)
    except (AttributeError, TypeError, ValueError) as exc:
        raise DLiteConfigError(f"the {arch} target config lacks a field a drafter is sized from ({exc}).") from exc
    if N < 2:
        raise DLiteConfigError(
            f"the target has {N} decoder layer(s): DLite reads a layer's output below the last one, "
            "so it needs a target with at least 2 layers."
        )
    return TargetInfo(arch, mtype or SUPPORTED_TARGET_ARCHITECTURES[arch], H, V, N, nh, kvh, hd, inter)


def drafter_config_for_target(target, history: str = "none", **overrides) -> DLiteConfig:
    """THE derivation of a DLite drafter's config from its target (every command uses it).

    From the target (a HF checkpoint folder, config, model or config dict; unsupported
    architectures are refused, see ``target_info``):
      - hidden size and vocabulary: the target's (the drafter reads its hidden states and uses
        its frozen embedding and LM head);
      - captured layers: the proportional choice to 12 / 14 of 36 (``default_layer_ids``);
      - backbone layers at the target's width: its attention heads, KV heads, head dim and MLP
        size (as the method's peers; ``--init-from-target-layers`` can then copy target layers);
      - RNN rank hidden / 8 (the method: 320 for hidden 2560, 512 for 4096).
    For SmolLM2-135M (576 hidden, 9 / 3 heads, 1536 MLP, 30 layers) this is exactly the
    DLiteConfig defaults. ``overrides`` (any DLiteConfig field) win.
    """
    t = target_info(target)
    kw = dict(
        target_hidden_size=t.hidden_size, vocab_size=t.vocab_size, target_num_layers=t.num_layers,
        target_layer_ids=default_layer_ids(t.num_layers), target_model_type=t.model_type,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        intermediate_size=t.intermediate_size, rnn_rank=max(1, round(t.hidden_size / 8)), history=history,
    )
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return DLiteConfig(**kw)
