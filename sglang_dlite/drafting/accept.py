"""Acceptance of a chain of drafts against the target's verify pass (batched).

Layout: a round verifies ``W = K + 1`` positions per request, ``[anchor, d_1 .. d_K]``; row j of
the target's output scores the token after ``anchor + d_1..d_j``. So draft ``d_{j+1}`` is checked
against row j, and row ``a`` (the first rejected draft's row, or row K when all are accepted) gives
the bonus token.

The expected number of accepted drafts of a chain (``expected_accepted``) is defined here too: the
hybrid chooser scores its chains with it, and the skip-DLite rule (``drafting.chooser.needs_dlite``) reads it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def expected_accepted_prefixes(probs: Sequence[float]) -> List[float]:
    """``[E(0), E(1), .., E(n)]``: the expected accepted drafts when only a chain's first k drafts
    are verified, ``E(k) = sum_{i<=k} prod_{j<=i} p_j``, from ``probs[j]`` = the chance draft j is
    accepted given that every draft before it was."""
    out, s, reach = [0.0], 0.0, 1.0
    for p in probs:
        reach *= p
        s += reach
        out.append(s)
    return out


def expected_accepted(probs: Sequence[float]) -> float:
    """Expected accepted drafts of the whole chain: ``sum_i prod_{j<=i} p_j``."""
    return expected_accepted_prefixes(probs)[-1]


def greedy_accept(drafts: torch.Tensor, target_tokens: torch.Tensor):
    """drafts ``[B, K]``, the target's greedy tokens ``[B, K+1]`` -> (accepted ``[B]``, bonus ``[B]``).

    accepted = length of the longest prefix of drafts equal to the target's tokens; bonus = the
    target's token after it. Output then equals the target's own greedy output."""
    K = drafts.shape[1]
    match = (drafts == target_tokens[:, :K]).to(torch.int64)
    accepted = torch.cumprod(match, dim=1).sum(1)
    bonus = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


def greedy_accept_length(drafts: torch.Tensor, labels: torch.Tensor, valid: Optional[torch.Tensor] = None):
    """Committed tokens of a greedy round per row (accepted + 1), as float: training evaluation,
    where ``labels [B, K]`` is the target's greedy continuation and ``valid`` masks labels that do
    not exist (end of sequence, outside the loss span): acceptance stops there."""
    ok = drafts == labels
    if valid is not None:
        ok = ok & valid
    return 1.0 + torch.cumprod(ok.to(torch.float32), dim=1).sum(1)


def chain_rejection_sample(p: torch.Tensor, drafts: torch.Tensor, q: Optional[torch.Tensor] = None,
                           generator: Optional[torch.Generator] = None, uniforms: Optional[torch.Tensor] = None):
    """Speculative (rejection) sampling along a chain, batched. Keeps the target's distribution.

    p: ``[B, K+1, V]`` the target's (filtered) distributions per verify row; drafts ``[B, K]``;
    q: ``[B, K, V]`` the distributions the drafts were sampled from, or None for deterministic drafts
    (greedy drafter, lookup: q is one-hot). Draft j is accepted with probability
    ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is sampled from the residual
    ``max(p_j - q_j, 0)`` (normalized); if all K are accepted the bonus is sampled from ``p_K``.
    ``uniforms [B, K]`` may be passed to make the coins explicit (tests). Returns (accepted, bonus).
    """
    B, K = drafts.shape
    dev = p.device
    rows = torch.arange(B, device=dev)
    pd = p[:, :K].gather(2, drafts[..., None]).squeeze(2).float()  # [B, K]
    if q is None:
        ratio = pd
    else:
        qd = q.gather(2, drafts[..., None]).squeeze(2).float()
        ratio = torch.where(qd > 0, pd / qd.clamp_min(1e-30), torch.zeros_like(pd))
    u = uniforms if uniforms is not None else torch.rand((B, K), generator=generator, device=dev)
    ok = (u < ratio.clamp(max=1.0)).to(torch.int64)
    accepted = torch.cumprod(ok, dim=1).sum(1)
    dist = p[rows, accepted].float()  # [B, V]: p_K where everything was accepted
    rejected = accepted < K
    if bool(rejected.any()):
        j = accepted.clamp(max=K - 1)
        if q is None:
            resid = dist.clone()
            resid[rows, drafts[rows, j]] = 0.0
        else:
            resid = (dist - q[rows, j].float()).clamp_min(0.0)
        total = resid.sum(-1, keepdim=True)
        # p == q at a rejection is a measure-zero event; fall back to p itself then.
        resid = torch.where(total > 0, resid / total.clamp_min(1e-30), dist)
        dist = torch.where(rejected[:, None], resid, dist)
    bonus = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return accepted, bonus
