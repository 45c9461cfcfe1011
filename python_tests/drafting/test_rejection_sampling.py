"""Rejection sampling keeps the target's distribution (empirical, small vocabulary).

The chain process (draft K from q, verify, accept/resample, next round) is simulated with
position-dependent target distributions p_t. The joint law of the first two output tokens must be
p_0 x p_1. The tolerance is checked to be tight enough that a classic bug (resampling from p
instead of the residual max(p - q, 0)) fails it.
"""

from __future__ import annotations

import torch

from dlite_lab.reference.engine import rejection_sample

V, K, N = 4, 3, 20000
TOL = 0.03


def _dists(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(8, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(8, V, generator=g) * 1.5, -1)
    return p, q


def _simulate(p, q, sampler, deterministic_drafts=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(N):
        out = []
        while len(out) < 2:
            t = len(out)
            if deterministic_drafts:
                drafts = [int(q[t + j].argmax()) for j in range(K)]
                qq = None
            else:
                drafts = [int(torch.multinomial(q[t + j], 1, generator=g)) for j in range(K)]
                qq = q[t:t + K]
            a, tok = sampler(p[t:t + K + 1], qq, drafts, g)
            out += drafts[:a] + [tok]
        counts[out[0], out[1]] += 1
    return counts / N


def _tv(emp, p):
    return 0.5 * (emp - torch.outer(p[0], p[1])).abs().sum().item()


def _broken_sampler(p, q, drafts, g):
    """Accept test right, but resample from p on rejection (ignores the residual)."""
    for j, d in enumerate(drafts):
        if float(torch.rand((), generator=g)) < min(1.0, float(p[j, d] / q[j, d])):
            continue
        return j, int(torch.multinomial(p[j], 1, generator=g))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=g))


def test_sampled_chain_keeps_target_distribution():
    p, q = _dists(0)
    assert _tv(_simulate(p, q, rejection_sample), p) < TOL


def test_deterministic_drafts_keep_target_distribution():
    p, q = _dists(1)
    assert _tv(_simulate(p, q, rejection_sample, deterministic_drafts=True), p) < TOL


def test_tolerance_catches_a_broken_sampler():
    p, q = _dists(0)
    assert _tv(_simulate(p, q, _broken_sampler), p) > TOL
