"""bf16 ``nn.Linear`` layers on a CPU through oneDNN with prepacked weights.

``F.linear`` on a CPU re-lays a bf16 weight out on every call; oneDNN's packed layout
(``torch.ops.mkldnn._reorder_linear_weight`` once, ``_linear_pointwise`` per call) runs the same
GEMM ~1.3-1.5x faster for the few rows a drafter or a verify step has (SmolLM2 shapes, 2
threads: M = 4 rows 24 -> 16 ms over the target's 30 layers). ``pack_cpu_linears(module)``
switches every eligible layer of a module in place (the drafter in sglang's CPU serving path);
the packed copy is rebuilt if the weight tensor changes (new storage or an in-place update), and
anything else (float32, CUDA, gradients, no oneDNN) keeps ``nn.Linear``'s own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_HINT = 4


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _eligible(w: torch.Tensor) -> bool:
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (x.dtype != w.dtype or not _eligible(w) or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
        return F.linear(x, w, self.bias)
    key = (w.data_ptr(), w._version)
    if self._dlite_packed_key != key:
        self._dlite_packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), BATCH_HINT)
        self._dlite_packed_key = key
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), self._dlite_packed,
                                             self.bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


def pack_cpu_linears(module: nn.Module) -> int:
    """Route every bf16 CPU ``nn.Linear`` in ``module`` through a packed weight; returns how many."""
    if not available():
        return 0
    n = 0
    for lin in module.modules():
        if isinstance(lin, nn.Linear) and _eligible(lin.weight):
            lin._dlite_packed, lin._dlite_packed_key = None, None
            lin.forward = types.MethodType(_packed_forward, lin)
            n += 1
    return n
