"""bf16 ``nn.Linear`` layers on a CPU through oneDNN with prepacked weights.

``F.linear`` on a CPU re-lays a bf16 weight out on every call; oneDNN's packed layout
(``torch.ops.mkldnn._reorder_linear_weight`` once, ``_linear_pointwise`` per call) runs the same
GEMM ~1.3-1.5x faster for the few rows a drafter or a verify step has (SmolLM2 shapes, 2
threads: M = 4 rows 24 -> 16 ms over the target's 30 layers). ``pack_cpu_linears(module)``
switches every eligible layer of a module in place (the drafter in sglang's CPU serving path);
the packed copy is rebuilt if the weight tensor changes (new storage or an in-place update), and
anything else (float32, CUDA, gradients, no oneDNN) keeps ``nn.Linear``'s own forward. The CPU
stand-in for sglang's own linear layers (``cpu_support/sglang_cpu/dlite_cpu_packed_linear.py``)
uses the same ``pack_weight`` / ``packed_for`` / ``packed_linear``. ``MklPackedLinear`` is the
float32 counterpart (MKL's packed sgemm), used by the fast regeneration engine.
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


def _mkl_packable(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2


def mkl_available() -> bool:
    """Whether torch ships MKL's packed sgemm (``torch.ops.mkl._mkl_linear``, what inductor's CPU
    freezing uses for float32 linears)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class MklPackedLinear:
    """``F.linear(x, weight, bias)`` for a float32 [out, in] CPU weight packed once for MKL's sgemm.

    ``F.linear`` (MKL's unpacked sgemm) re-lays the weight out on every call, which for the few
    rows of a decode or verify step is a large part of the cost: SmolLM2-135M's 30 layers + LM
    head, 1 thread, best of 3 interleaved, M = 4 / 8 / 32 / 64 rows: 92 / 128 / 131 / 191 ms
    unpacked vs 71 / 83 / 110 / 150 ms packed (1.15-1.5x; ``bench/gen_throughput.py``'s
    fast-spec vs fast-spec-unpacked rows measure the end-to-end effect).
    The pack does not depend on the row count, so one packed copy (~1.05x the weight's bytes)
    serves every M. The result equals ``F.linear``'s bit for bit from ~16 rows up; below, MKL's
    unpacked path takes another kernel and they differ in the last bits (as any two GEMM shapes).
    Above ``MAX_ROWS`` rows (a prefill) the packing gains nothing (200-400 rows: 0.97-1.02x,
    noisy) and ``F.linear`` runs instead.
    """

    __slots__ = ("weight", "bias", "packed")
    MAX_ROWS = 128

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor = None):
        if not _mkl_packable(weight):
            raise ValueError(f"MklPackedLinear needs a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}.")
        if not mkl_available():
            raise RuntimeError("this torch build has no MKL packed sgemm (torch.ops.mkl._mkl_linear); "
                               "use F.linear (MklPackedLinear.maybe returns it).")
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)

    @classmethod
    def maybe(cls, weight: torch.Tensor, bias: torch.Tensor = None):
        """A packed linear where MKL packing applies (float32 CPU weight, MKL present), else a
        closure over ``F.linear``: the same call either way."""
        if _mkl_packable(weight) and mkl_available():
            return cls(weight, bias)
        return functools.partial(F.linear, weight=weight, bias=bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"MklPackedLinear: input is {x.dtype}, the packed weight float32.")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*shape[:-1], self.weight.shape[0])
        if x2.shape[0] > self.MAX_ROWS:
            out = F.linear(x2, self.weight, self.bias)
        else:
            out = torch.ops.mkl._mkl_linear(x2, self.packed, self.weight, self.bias, x2.shape[0])
        return out.view(*shape[:-1], out.shape[-1])


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
