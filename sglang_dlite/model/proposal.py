"""``DraftProposal``: what every drafter answers the engine each round.

The DLite drafter's ``propose``, the lab's reference-engine drafters (``dlite_lab/reference/drafters.py``,
``dlite_lab/baselines/``) and the SGLang worker all speak it; ``DraftRequest`` is the lab's question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, K] drafted token ids
    probs: Optional[torch.Tensor]  # [B, K, V] the distribution each token was sampled from (None if greedy)
    # [B, K] the drafter's probability of each greedy draft (softmax max over the drafting
    # vocabulary), when asked for (``return_confidence``): its own acceptance estimate.
    confidence: Optional[torch.Tensor] = None
    source: Optional[str] = None  # which drafting source made the chain (hybrid drafting)
    score: Optional[float] = None  # the source's expected accepted drafts (hybrid drafting)
    # a token tree to verify instead of the chain (tree drafters: ``drafting/hybrid.py``); then
    # ``tokens`` is [1, N-1], the tree's drafts in node order, and ``probs`` is None (q one-hot)
    tree: Optional[object] = None  # a sglang_dlite.drafting.tree.DraftTree (drafting builds on this module)
    # [B, K, k] / [B, K, k]: the k likeliest tokens at each position of the greedy chain and their
    # probabilities (``DLiteDrafter.propose(top_k=k)``; entry 0 is the chain's own token)
    top_tokens: Optional[torch.Tensor] = None
    top_probs: Optional[torch.Tensor] = None
