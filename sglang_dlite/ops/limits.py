"""Launch limits of the CUDA kernels, mirrored from ``csrc/cuda/dlite_cuda.cu`` so the dispatcher can
route a shape before it launches (``python_tests/ops/test_kernel_emulation.py`` asserts the two agree).

Only ``round_attention`` takes dynamic shared memory that grows with the round: K and V of a tile of
keys in fp32 (key rows padded to D+1 floats) plus, per warp, the rotated query, the scores and the
output row. The kernel stages the whole round when it fits the device's opt-in limit, else the
largest multiple of 32 keys that does (an online softmax across tiles). The other kernels use a
few hundred bytes of static shared memory.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import torch

ATTENTION_THREADS = 128  # kAttentionThreads
WARP = 32
SM90_SMEM_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin of H100 / H200 / H800
SM80_SMEM_OPTIN = 166912  # A100


def round_attention_smem_bytes(tile: int, head_dim: int) -> int:
    """dlite_round_attention_smem_bytes: bytes of dynamic shared memory for ``tile`` keys."""
    nwarps = ATTENTION_THREADS // WARP
    return 4 * (tile * (head_dim + 1) + tile * head_dim + nwarps * (2 * head_dim + tile))


def round_attention_plan(rows: int, head_dim: int, smem_limit: int = SM90_SMEM_OPTIN) -> Optional[Tuple[int, int]]:
    """dlite_round_attention_plan: (key tile, shared-memory bytes), or None when not even 32 keys fit."""
    tile = rows
    if round_attention_smem_bytes(tile, head_dim) > smem_limit:
        per_key = 4 * (2 * head_dim + 1 + ATTENTION_THREADS // WARP)
        fixed = round_attention_smem_bytes(0, head_dim)
        tile = (smem_limit - fixed) // per_key // WARP * WARP if smem_limit > fixed else 0
        tile = min(tile, rows)
    smem = round_attention_smem_bytes(tile, head_dim)
    if tile >= 1 and (tile == rows or tile >= WARP) and smem <= smem_limit:
        return tile, smem
    return None


def device_smem_optin(device) -> int:
    """The opt-in shared memory per block of a CUDA device (bytes); asked once per device, so a
    draft round inside a CUDA graph capture does no device query."""
    index = torch.device(device).index
    return _smem_optin_of(torch.cuda.current_device() if index is None else index)


@lru_cache(maxsize=None)
def _smem_optin_of(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", SM90_SMEM_OPTIN))
