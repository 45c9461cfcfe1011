"""Draft-step ops behind one dispatcher.

Each op has a torch reference in ``reference.py``; compiled kernels from ``csrc/`` (C++ for the
CPU, CUDA for Ampere/Hopper) replace it when they are built. The dispatcher picks
CUDA > C++ CPU > torch; ``SGLANG_DLITE_OPS=torch|cpp|cuda`` forces a path.
"""

from __future__ import annotations

from .reference import (  # noqa: F401  (re-exported: the model uses these helpers directly)
    apply_rope,
    rms_norm,
    rope_cos_sin,
    round_attention_mask,
    round_positions,
)
from . import reference as _ref


def assemble_round_inputs(*args, **kwargs):
    return _ref.assemble_round_inputs(*args, **kwargs)


def round_attention(*args, **kwargs):
    return _ref.round_attention(*args, **kwargs)


def lowrank_rnn_scan(gate_logits, inputs):
    return _ref.lowrank_rnn_scan(gate_logits, inputs)
