"""The config base of every drafter here (DLite and the EAGLE-3 / DFlash / DSpark baselines): the
target's shape, which target layers to capture, the drafter's own transformer shape, and the checks
they share (in range, consistent, fits the target). Each drafter's config adds its own fields and
checks on top (``DLiteConfig`` in ``config.py``, ``BaselineConfig`` in ``baselines/common.py``).

A transformers ``PretrainedConfig``: sglang and ``AutoConfig`` read the generic names
(hidden_size, num_hidden_layers, num_attention_heads) from any draft config.
"""

from __future__ import annotations

from typing import Optional, Sequence

from transformers import PretrainedConfig

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.targets import target_info

MAX_BLOCK_SIZE = 16


class DrafterConfig(PretrainedConfig):
    """Shared fields (defaults: a drafter for SmolLM2-135M) and checks of the drafter configs."""

    # Class attributes carry no annotations: transformers turns every config subclass into a
    # dataclass, and an annotated attribute would become a config field.
    model_type = "dlite-drafter"
    display_name = None  # in messages (default: model_type)
    retrain_hint = "Use a drafter trained for this target, or train one with `sglang-dlite train`."

    def __init__(
        self,
        target_hidden_size: int = 576,
        vocab_size: int = 49152,
        target_num_layers: int = 30,
        target_layer_ids: Optional[Sequence[int]] = None,
        block_size: int = 7,
        num_layers: int = 1,
        num_heads: int = 9,
        num_kv_heads: int = 3,
        head_dim: int = 64,
        intermediate_size: int = 1536,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        target_model_type: Optional[str] = None,
        **kwargs,
    ):
        self.target_hidden_size = int(target_hidden_size)
        self.vocab_size = int(vocab_size)
        self.target_num_layers = int(target_num_layers)
        self.target_layer_ids = (list(target_layer_ids) if target_layer_ids is not None
                                 else self.default_layer_ids(self.target_num_layers))
        self.block_size = int(block_size)
        self.num_layers = int(num_layers)
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.intermediate_size = int(intermediate_size)
        self.rope_theta = float(rope_theta)
        self.rms_norm_eps = float(rms_norm_eps)
        self.target_model_type = target_model_type
        kwargs.setdefault("hidden_size", self.target_hidden_size)
        kwargs.setdefault("num_hidden_layers", self.num_layers)
        kwargs.setdefault("num_attention_heads", self.num_heads)
        super().__init__(**kwargs)
        self.validate()

    @staticmethod
    def default_layer_ids(num_target_layers: int) -> list:
        """The target layers this drafter captures when the config names none."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.display_name or self.model_type

    @property
    def num_capture_layers(self) -> int:
        return len(self.target_layer_ids)

    def invalid(self, msg: str):
        raise DLiteConfigError(f"invalid {self.name} config: {msg}")

    def validate(self) -> None:
        """Raise DLiteConfigError naming the first field out of range."""
        bad = self.invalid
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            bad(f"block_size K={self.block_size} is out of range; it must be in [1, {MAX_BLOCK_SIZE}].")
        if self.num_layers < 1:
            bad(f"num_layers={self.num_layers} must be >= 1.")
        ids = self.target_layer_ids
        if not ids:
            bad("target_layer_ids is empty; name at least one target layer to capture.")
        if len(set(ids)) != len(ids):
            bad(f"target_layer_ids={ids} has duplicates.")
        for lid in ids:
            if not 0 <= lid < self.target_num_layers:
                bad(f"target layer id {lid} is out of range for a target with {self.target_num_layers} layers "
                    f"(valid: 0..{self.target_num_layers - 1}).")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            bad(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}.")
        if self.head_dim % 2:
            bad(f"head_dim={self.head_dim} must be even (RoPE rotates pairs).")

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
            problems.append(f"layer ids {bad_ids} are out of range for a target with {num_layers} layers")
        if problems:
            raise DLiteConfigError(f"this {self.name} drafter does not match the target model ("
                                   + "; ".join(problems) + f"). {self.retrain_hint}")

    @classmethod
    def for_target(cls, target, **overrides) -> "DrafterConfig":
        """The one derivation of a drafter config from its target (a HF checkpoint folder, config,
        model or config dict; unsupported architectures are refused: ``target_support.target_info``):
        the target's hidden size, vocabulary and depth, the class's default capture layers for that
        depth, drafter layers at the target's width (attention heads, KV heads, head dim, MLP
        size), plus the class's own ``derived_from_target`` fields. ``overrides`` win (None:
        derived). For SmolLM2-135M this gives the class defaults."""
        t = target_info(target)
        kw = dict(target_hidden_size=t.hidden_size, vocab_size=t.vocab_size, target_num_layers=t.num_layers,
                  target_model_type=t.model_type)
        width = dict(num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                     intermediate_size=t.intermediate_size)
        kw.update({k: v for k, v in width.items() if v is not None})
        kw.update(cls.derived_from_target(t))
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    @staticmethod
    def derived_from_target(t) -> dict:
        """Fields a drafter class derives from the target beyond the shared ones (``for_target``)."""
        return {}
