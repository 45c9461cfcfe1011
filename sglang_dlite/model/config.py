"""DLiteConfig: every shape and design choice of a DLite drafter, saved as config.json.

A transformers ``PretrainedConfig`` (``model_type="dlite"``) so that sglang, which parses every
draft-model path with ``AutoConfig``, can read a DLite checkpoint once the plugin registers it.
"""

from __future__ import annotations

from typing import Optional

from sglang_dlite.model.drafter_config import MAX_BLOCK_SIZE, DrafterConfig  # noqa: F401  (MAX_BLOCK_SIZE: re-exported)
from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.targets import (  # noqa: F401  (re-exported: the supported targets and their shape)
    SUPPORTED_TARGET_ARCHITECTURES, TargetInfo, supported_targets_text, target_info,
)

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


def proportional_layer_ids(num_target_layers: int) -> list[int]:
    """The method's proportional choice to layers 12 and 14 of a 36-layer target (DLITE.md), kept
    inside 0..N-2: sglang never captures the last layer's output (it is the final hidden state).
    An ablation: ``low_mid_high_layer_ids`` beat it on held-out tau and is the default."""
    top = max(num_target_layers - 2, 0)
    a = min(max(round(12 * num_target_layers / 36), 0), top)
    b = min(max(round(14 * num_target_layers / 36), a + 1), top)
    return [a] if a == b else [a, b]


def low_mid_high_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high layers ``[2, N // 2, N - 3]`` (sglang's own EAGLE-3 default),
    clipped to 0..N-2 and de-duplicated for shallow targets: DLite's default. For the 30-layer
    SmolLM2 this is 2, 15, 27: the shipped drafter's layers (they beat the proportional 10, 12 on
    held-out tau)."""
    top = max(num_target_layers - 2, 0)
    return sorted({min(max(i, 0), top) for i in (2, num_target_layers // 2, num_target_layers - 3)})


class DLiteConfig(DrafterConfig):
    """DLite's config: the drafter config base (target shape, capture layers, transformer shape and
    their checks, shared with the baselines) + DLite's context window, RNN head and history modes.

    The defaults are the shipped design: ``DLiteConfig()`` is the shipped SmolLM2-135M drafter's
    shape (3 backbone layers, the token-fed head, layers 2, 15, 27, K = 7, C = 4), less its drafting
    vocabulary (a property of its training data). The ablations are explicit values of the same
    fields (``history``, ``head_input="hidden"``, ``proportional_layer_ids``), built by the lab."""

    model_type = "dlite"
    display_name = "DLite"
    default_layer_ids = staticmethod(low_mid_high_layer_ids)

    @staticmethod
    def derived_from_target(t) -> dict:
        """DLite's own target-derived field (``for_target``): the RNN rank, hidden / 8."""
        return {"rnn_rank": max(1, round(t.hidden_size / 8))}

    def __init__(
        self,
        num_context_positions: int = 4,
        num_layers: int = 3,
        rnn_rank: int = 72,
        block_attention: str = "bidirectional",
        history: str = "none",
        head_input: str = "token",
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


def drafter_config_for_target(target, history: str = "none", **overrides) -> DLiteConfig:
    """THE derivation of a DLite drafter's config from its target (every command uses it):
    ``DLiteConfig.for_target``. From the target (a HF checkpoint folder, config, model or config
    dict; unsupported architectures are refused, see ``targets.target_info``):
      - hidden size and vocabulary: the target's (the drafter reads its hidden states and uses
        its frozen embedding and LM head);
      - captured layers: low / mid / high, ``[2, N // 2, N - 3]`` (``low_mid_high_layer_ids``);
      - backbone layers at the target's width: its attention heads, KV heads, head dim and MLP
        size (as the method's peers; ``--init-from-target-layers`` can then copy target layers);
      - RNN rank hidden / 8 (the method: 320 for hidden 2560, 512 for 4096).
    For SmolLM2-135M (576 hidden, 9 / 3 heads, 1536 MLP, 30 layers) this is exactly the
    DLiteConfig defaults. ``overrides`` (any DLiteConfig field; None = derived) win.
    """
    return DLiteConfig.for_target(target, history=history, **overrides)
