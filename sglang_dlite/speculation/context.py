"""The drafter's context window: the captured target rows of the last C committed positions.

DLite reads only these rows (and nothing older), which is why its cost does not grow with the
context. Near the start of a sequence fewer than C rows exist: they are left-padded with zeros
and marked invalid (``valid[c] = False``), so slot C-1 is always the newest committed position.
"""

from __future__ import annotations

import torch


def last_rows(rows: torch.Tensor, C: int, dim: int = -2):
    """The last C rows of ``rows`` along ``dim`` (left-padded with zeros), and validity ``[C]``.

    ``rows``: e.g. ``[L, T, H]`` captured states of one request (dim=-2: positions)."""
    dim = dim % rows.dim()
    T = rows.shape[dim]
    n = min(C, T)
    shape = list(rows.shape)
    shape[dim] = C
    out = rows.new_zeros(shape)
    if n:
        out.narrow(dim, C - n, n).copy_(rows.narrow(dim, T - n, n))
    valid = torch.zeros(C, dtype=torch.bool, device=rows.device)
    valid[C - n:] = True
    return out, valid


def last_rows_of_segments(rows: torch.Tensor, seg_lens, C: int):
    """Batched over requests packed back to back (sglang's extend layout).

    rows ``[sum(seg_lens), D]``, seg_lens (B ints or a tensor) -> ``[B, C, D]`` (the last C rows of
    each segment, left-padded with zeros) and validity ``[B, C]``."""
    lens = torch.as_tensor(seg_lens, dtype=torch.int64).cpu()
    ends = torch.cumsum(lens, 0)
    j = torch.arange(C, dtype=torch.int64)
    idx = ends[:, None] - C + j[None, :]  # [B, C]
    valid = j[None, :] >= (C - torch.clamp(lens, max=C))[:, None]
    idx = torch.where(valid, idx, torch.zeros_like(idx)).to(rows.device)
    valid = valid.to(rows.device)
    out = rows[idx] * valid[..., None].to(rows.dtype)
    return out, valid
