"""DLiteConfig: every shape and design choice of a DLite drafter, saved as config.json.

A transformers ``PretrainedConfig`` (``model_type="dlite"``) so that sglang, which parses every
draft-model path with ``AutoConfig``, can read a DLite checkpoint once the plugin registers it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from transformers import PretrainedConfig

from .errors import DLiteConfigError

MAX_BLOCK_SIZE = 16
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
    """The proportional choice to layers 12 and 14 of a 36-layer target (DLITE.md)."""
    a = round(12 * num_target_layers / 36)
    b = round(14 * num_target_layers / 36)
    a = min(max(a, 0), num_target_layers - 1)
    b = min(max(b, a + 1), num_target_layers - 1)
    return [a] if a == b else [a, b]


class DLiteConfig(PretrainedConfig):
    model_type = "dlite"

    def __init__(
        self,
        target_hidden_size: int = 576,
        vocab_size: int = 49152,
        target_num_layers: int = 30,
        target_layer_ids: Optional[Sequence[int]] = None,
        num_context_positions: int = 4,
        block_size: int = 7,
        num_layers: int = 2,
        num_heads: int = 9,
        num_kv_heads: int = 3,
        head_dim: int = 64,
        intermediate_size: int = 1536,
        rnn_rank: int = 72,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        block_attention: str = "bidirectional",
        history: str = "none",
        head_input: str = "hidden",
        target_model_type: Optional[str] = None,
        draft_vocab_size: int = 0,
        **kwargs,
    ):
        self.target_hidden_size = int(target_hidden_size)
        self.vocab_size = int(vocab_size)
        self.target_num_layers = int(target_num_layers)
        self.target_layer_ids = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else default_layer_ids(self.target_num_layers)
        )
        self.num_context_positions = int(num_context_positions)
        self.block_size = int(block_size)
        self.num_layers = int(num_layers)
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.intermediate_size = int(intermediate_size)
        self.rnn_rank = int(rnn_rank)
        self.rope_theta = float(rope_theta)
        self.rms_norm_eps = float(rms_norm_eps)
        self.block_attention = block_attention
        self.history = history
        self.head_input = head_input
        self.target_model_type = target_model_type
        # >0: drafts are chosen among this many tokens (the ``draft_vocab`` buffer of the
        # checkpoint: the training data's most frequent ids); 0: the whole vocabulary.
        self.draft_vocab_size = int(draft_vocab_size)
        # sglang reads these generic names from any draft config.
        kwargs.setdefault("hidden_size", self.target_hidden_size)
        kwargs.setdefault("num_hidden_layers", self.num_layers)
        kwargs.setdefault("num_attention_heads", self.num_heads)
        kwargs.setdefault("architectures", ["DLiteDrafter"])
        super().__init__(**kwargs)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def bad(msg: str):
            raise DLiteConfigError(f"invalid DLite config: {msg}")

        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            bad(f"block_size K={self.block_size} is out of range; it must be in [1, {MAX_BLOCK_SIZE}].")
        if not 0 <= self.num_context_positions <= MAX_CONTEXT_POSITIONS:
            bad(
                f"num_context_positions={self.num_context_positions} must be in "
                f"[0, {MAX_CONTEXT_POSITIONS}] (a small window, independent of context length)."
            )
        if not self.target_layer_ids:
            bad("target_layer_ids is empty; name at least one target layer to capture.")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            bad(f"target_layer_ids={self.target_layer_ids} has duplicates.")
        for lid in self.target_layer_ids:
            if not 0 <= lid < self.target_num_layers:
                bad(
                    f"target layer id {lid} is out of range for a target with "
                    f"{self.target_num_layers} layers (valid: 0..{self.target_num_layers - 1})."
                )
        if self.num_heads % max(self.num_kv_heads, 1) != 0 or self.num_kv_heads < 1:
            bad(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}.")
        if self.head_dim % 2:
            bad(f"head_dim={self.head_dim} must be even (RoPE rotates pairs).")
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
    def num_capture_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def history_window(self) -> Optional[int]:
        """0 for DLite (no history), W for a window, None for the full-history teacher."""
        return parse_history(self.history)

    def check_target(self, *, hidden_size: int, vocab_size: int, num_layers: int,
                     model_type: Optional[str] = None) -> None:
        """Raise a clear error when this drafter was built for another target."""
        problems = []
        if hidden_size != self.target_hidden_size:
            problems.append(f"hidden size: drafter expects {self.target_hidden_size}, target has {hidden_size}")
        if vocab_size != self.vocab_size:
            problems.append(f"vocabulary: drafter expects {self.vocab_size} tokens, target has {vocab_size}")
        bad_ids = [i for i in self.target_layer_ids if not 0 <= i < num_layers]
        if bad_ids:
            problems.append(
                f"layer ids {bad_ids} are out of range for a target with {num_layers} layers"
            )
        if problems:
            raise DLiteConfigError(
                "this DLite drafter does not match the target model ("
                + "; ".join(problems)
                + "). Use a drafter trained for this target, or train one with `sglang-dlite train`."
            )
