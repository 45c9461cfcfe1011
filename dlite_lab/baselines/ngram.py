"""Prompt lookup / n-gram drafter (baseline, no training, no target features).

Match the last n committed tokens (n = max_ngram down to min_ngram) at an earlier place in the
committed context (the most recent match wins) and propose the K tokens that followed it. The copy
is LZ77-style, so a match that runs into the end of the context continues with its own proposals
(a repeating pattern is continued for all K tokens). Without a match it proposes the anchor
repeated (rejected at once unless the text really repeats): tau is then 1, as with no drafter.
Strong on agent traces that quote their context; costs a vectorized O(context) scan per round.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from dlite_lab.reference.drafters import DraftRequest
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.proposal import DraftProposal


def lookup(tokens, block_size: int, max_ngram: int = 3, min_ngram: int = 1) -> Optional[list]:
    """The K-token continuation of the most recent earlier match of the longest suffix n-gram
    (n from max_ngram down to min_ngram), or None if no suffix n-gram occurs earlier."""
    arr = np.asarray(tokens, dtype=np.int64)
    T = len(arr)
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        suffix = arr[T - n:]
        # candidate starts j in [0, T-n-1]: the match must end before the suffix starts ending
        hit = np.ones(T - n, dtype=bool)
        for i in range(n):
            hit &= arr[i:T - n + i] == suffix[i]
        js = np.flatnonzero(hit)
        if len(js):
            src = int(js[-1]) + n
            out = list(arr[src:src + block_size])
            seq = list(arr) + out
            while len(out) < block_size:  # LZ77 copy: overlap with the proposals themselves
                out.append(seq[src + len(out)])
                seq.append(out[-1])
            return [int(t) for t in out]
    return None


class NGramDrafter:
    """Engine adapter. Needs no checkpoint and no hidden states (captures one layer, keeps one row,
    because the engine always captures something)."""

    def __init__(self, num_drafts: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise DLiteInputError(f"n-gram sizes must satisfy 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram}).")
        self.num_drafts = num_drafts
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.capture_layer_ids = [0]
        self.hidden_rows_needed = 1

    def memory_bytes(self, state: dict) -> int:
        return 0  # reads the engine's committed tokens; keeps nothing of its own

    def draft(self, req: DraftRequest) -> DraftProposal:
        out = lookup(req.tokens, self.num_drafts, self.max_ngram, self.min_ngram)
        if out is None:
            out = [int(req.tokens[-1])] * self.num_drafts
        return DraftProposal(torch.tensor([out]), None)
