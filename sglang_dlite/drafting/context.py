"""The drafter's context window: the captured target rows of the last C committed positions.

DLite reads only these rows (and nothing older), which is why its cost does not grow with the
context. Near the start of a sequence fewer than C rows exist: they are left-padded with zeros
and marked invalid (``valid[c] = False``), so slot C-1 is always the newest committed position.
"""

from __future__ import annotations

import torch


def context_positions(ends, C: int, starts=0):
    """The window itself: for each request the C positions ``end - C .. end - 1`` before its
    ``end`` (exclusive) and which of them exist (``>= start``). Returns (positions ``[B, C]``,
    0 where invalid; validity ``[B, C]``). The engines' rows and the trainer's batches
    (``training/dataset.py``) all index by it."""
    ends = torch.as_tensor(ends, dtype=torch.int64)
    pos = ends[:, None] - C + torch.arange(C, dtype=torch.int64)[None, :]
    valid = pos >= torch.as_tensor(starts, dtype=torch.int64).reshape(-1, 1)
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


def last_rows(rows: torch.Tensor, C: int, dim: int = -2):
    """The last C rows of ``rows`` along ``dim`` (left-padded with zeros), and validity ``[C]``.

    ``rows``: e.g. ``[L, T, H]`` captured states of one request (dim=-2: positions)."""
    dim = dim % rows.dim()
    pos, valid = context_positions([rows.shape[dim]], C)
    pos, valid = pos[0].to(rows.device), valid[0].to(rows.device)
    shape = [1] * rows.dim()
    shape[dim] = C
    if rows.shape[dim] == 0:  # nothing to gather from: every slot is padding
        return rows.new_zeros([C if d == dim else n for d, n in enumerate(rows.shape)]), valid
    return rows.index_select(dim, pos).masked_fill_(~valid.view(shape), 0), valid


def last_rows_of_segments(rows: torch.Tensor, seg_lens, C: int):
    """Batched over requests packed back to back (sglang's extend layout).

    rows ``[sum(seg_lens), D]``, seg_lens (B ints or a tensor) -> ``[B, C, D]`` (the last C rows of
    each segment, left-padded with zeros) and validity ``[B, C]``."""
    lens = torch.as_tensor(seg_lens, dtype=torch.int64).cpu()
    ends = torch.cumsum(lens, 0)
    idx, valid = context_positions(ends, C, ends - lens)
    idx, valid = idx.to(rows.device), valid.to(rows.device)
    out = rows[idx] * valid[..., None].to(rows.dtype)
    return out, valid


def roll_last_rows(window: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A round's carry, batched: per request the last C rows of ``[window, rows[:keep]]``.

    window ``[B, C, D]`` (the context before the round), rows ``[B, W, D]`` (the round's verify
    rows: anchor, drafts), keep ``[B]`` (rows committed: accepted drafts + 1) -> ``[B, C, D]``."""
    C = window.shape[1]
    cat = torch.cat([window, rows], dim=1)  # [B, C+W, D]
    idx = keep[:, None] + torch.arange(C, device=window.device)[None, :]
    return cat.gather(1, idx[..., None].expand(-1, -1, cat.shape[-1]))
