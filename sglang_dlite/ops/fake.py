"""Fake (meta) kernels of ``torch.ops.sglang_dlite.*``: output shape, dtype and device only.

They let the compiled ops run under FakeTensor tracing (``torch.compile``, ``torch.export``,
``torch.library.opcheck``). The schemas are in ``csrc/schemas.cpp``, which names this module
(``set_python_module``) so torch imports it when a fake kernel is first needed; ``_ext.load``
also imports it right after loading the library. The shapes follow ``reference.py``.
"""

from __future__ import annotations

import torch

_registered = False


def register() -> None:
    """Register the fake kernels once (the library must be loaded: the ops must exist)."""
    global _registered
    if _registered or not hasattr(torch.ops, "sglang_dlite") or not hasattr(torch.ops.sglang_dlite, "lowrank_rnn_scan"):
        return
    _registered = True

    @torch.library.register_fake("sglang_dlite::assemble_round_inputs")
    def _assemble(context_hidden, anchor_embeds, ctx_norm_weight, depth_embed, mask_embed, block_size, eps):
        B, L, C, H = context_hidden.shape
        return anchor_embeds.new_empty((B, L * C + 1 + block_size, H))

    @torch.library.register_fake("sglang_dlite::round_attention")
    def _attention(q, k, v, cos, sin, context_valid, num_layers, block_size, causal):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("sglang_dlite::lowrank_rnn_scan")
    def _scan(gate_logits, inputs):
        return torch.empty_like(inputs, memory_format=torch.contiguous_format)

    @torch.library.register_fake("sglang_dlite::lm_head_argmax")
    def _argmax(hidden, norm_weight, eps, lm_head_weight):
        return hidden.new_empty(hidden.shape[:-1], dtype=torch.int64)

    if hasattr(torch.ops.sglang_dlite, "kv_cache_attention"):  # a library built before the op existed lacks it
        @torch.library.register_fake("sglang_dlite::kv_cache_attention")
        def _kv_attention(q, k_cache, v_cache, starts, lens, scale):
            return torch.empty_like(q, memory_format=torch.contiguous_format)


try:  # imported by torch on demand (set_python_module) once the library is loaded
    register()
except Exception:  # noqa: BLE001 - never break an import; _ext.load() registers again
    _registered = False
