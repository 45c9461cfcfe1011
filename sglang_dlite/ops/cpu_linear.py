"""bf16 ``nn.Linear`` layers on a CPU through oneDNN with prepacked weights.

``F.linear`` on a CPU re-lays a bf16 weight out on every call; oneDNN's packed layout
(``torch.ops.mkldnn._reorder_linear_weight`` once, ``_linear_pointwise`` per call) runs the same
GEMM ~1.3-1.5x faster for the few rows a drafter or a verify step has (SmolLM2 shapes, 2
threads: M = 4 rows 24 -> 16 ms over the target's 30 layers). ``pack_cpu_linears(module)``
switches every eligible layer of a module in place (the drafter in sglang's CPU serving path);
the packed copy is rebuilt if the weight tensor changes (new storage or an in-place update), and
anything else (float32, CUDA, gradients, no oneDNN) keeps ``nn.Linear``'s own forward. The CPU
stand-in for sglang's own linear layers (``cpu_support/sglang_cpu/dlite_cpu_packed_linear.py``)
uses the same ``pack_weight`` / ``packed_for`` / ``packed_linear``.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_HINT = 4


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set:
    """The first processor's feature flags in ``cpuinfo`` (empty where the file is missing)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (avx512_bf16 or AMX-BF16). Without it oneDNN emulates
    bf16 and few-row fp32 GEMVs are the faster ones (an avx512 CPU without avx512_bf16: DLite's
    draft round in fp32 13.7-18.0 ms vs packed bf16 17.2-42.6 ms, batch 1-4, 3-7 drafts)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether oneDNN's packed bf16 linear runs here: torch has oneDNN and the op, and the CPU has
    what oneDNN's bf16 path needs (avx512bw/vl/dq or avx_ne_convert; an AVX2-only CPU, e.g. an
    AMD EPYC without AVX-512, has not: there ``_reorder_linear_weight`` raises, so nothing is
    packed and ``F.linear`` runs)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    bf16_ok = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(bf16_ok()) if bf16_ok is not None else True


def _eligible(w: torch.Tensor) -> bool:
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2


def can_pack(w) -> bool:
    """Whether ``pack_weight`` applies: a [out, in] bf16 CPU weight, and oneDNN's bf16 path runs
    on this CPU (``available``)."""
    return w is not None and available() and _eligible(w)


def pack_weight(w: torch.Tensor):
    """The oneDNN-packed copy of a [out, in] bf16 CPU weight, or None where packing does not apply."""
    if not can_pack(w):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), BATCH_HINT)


def packed_for(holder, w: torch.Tensor):
    """``holder``'s packed copy of ``w`` (kept on it), repacked when ``w`` changed: new storage or
    an in-place update (e.g. sglang's update_weights_from_disk)."""
    key = (w.data_ptr(), w._version)
    if getattr(holder, "_dlite_packed_key", None) != key:
        holder._dlite_packed = pack_weight(w)
        holder._dlite_packed_key = key
    return holder._dlite_packed


def packed_linear(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight; x [..., in] bf16."""
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (x.dtype != w.dtype or not _eligible(w) or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
        return F.linear(x, w, self.bias)
    return packed_linear(x, packed_for(self, w), self.bias)


def pack_cpu_linears(module: nn.Module) -> int:
    """Route every bf16 CPU ``nn.Linear`` in ``module`` through a packed weight; returns how many."""
    if not available():
        return 0
    n = 0
    for lin in module.modules():
        if isinstance(lin, nn.Linear) and _eligible(lin.weight):
            lin.forward = types.MethodType(_packed_forward, lin)
            n += 1
    return n
