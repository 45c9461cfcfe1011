"""The speculative core (sglang_dlite/drafting, model/sampling): acceptance, rejection sampling, τ,
context, filters."""

from __future__ import annotations

import pytest
import torch

from sglang_dlite import drafting as spec
from sglang_dlite.model import sampling


def _brute_greedy(drafts, target):
    out = []
    for d, t in zip(drafts.tolist(), target.tolist()):
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        out.append((a, t[a]))
    return out


@pytest.mark.parametrize("K", [1, 3, 7])
def test_greedy_accept_is_longest_matching_prefix(K):
    g = torch.Generator().manual_seed(K)
    target = torch.randint(0, 3, (200, K + 1), generator=g)
    drafts = torch.where(torch.rand(200, K, generator=g) < 0.7, target[:, :K], torch.randint(0, 3, (200, K), generator=g))
    a, bonus = spec.greedy_accept(drafts, target)
    assert list(zip(a.tolist(), bonus.tolist())) == _brute_greedy(drafts, target)
    # every accept length occurs (the test can see an off-by-one)
    assert set(a.tolist()) == set(range(K + 1))


def test_greedy_accept_length_stops_at_invalid_labels():
    d = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3]])
    lab = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    valid = torch.tensor([[True, True, True], [True, False, True], [True, True, True]])
    assert spec.greedy_accept_length(d, lab, valid).tolist() == [4.0, 2.0, 2.0]
    assert spec.greedy_accept_length(d, lab).tolist() == [4.0, 4.0, 2.0]


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_chain_rejection_sampling_keeps_the_target_law(sampled_drafts):
    """First committed token ~ p_0; second ~ p_1 given the first equals d_1 (V = 4, K = 2)."""
    torch.manual_seed(0)
    V, K, N = 4, 2, 200000
    p = torch.softmax(torch.randn(K + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V), -1)
    g = torch.Generator().manual_seed(1)
    if sampled_drafts:
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
        qb = q[None].expand(N, K, V)
    else:
        drafts = p[:K].argmax(-1)[None].expand(N, K)  # a greedy drafter's choice
        qb = None
    # p rows are the target's law given the drafted prefix: only row 0 is prefix-independent, so
    # check row 1 on the requests whose first draft was d=drafts[:,0] and got accepted.
    a, bonus = spec.chain_rejection_sample(p[None].expand(N, K + 1, V), drafts, qb, generator=g)
    first = torch.where(a >= 1, drafts[:, 0], bonus)
    emp0 = torch.bincount(first, minlength=V).float() / N
    assert _tv(emp0, p[0]) < 0.008
    sel = a >= 1
    second = torch.where(a[sel] >= 2, drafts[sel, 1], bonus[sel])
    emp1 = torch.bincount(second, minlength=V).float() / int(sel.sum())
    assert sel.sum() > 20000 and _tv(emp1, p[1]) < 0.012


def test_chain_rejection_explicit_coins():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    d = torch.tensor([[1]])
    a, b = spec.chain_rejection_sample(p, d, uniforms=torch.tensor([[0.4]]))
    assert a.tolist() == [1] and b.tolist() == [2]  # accepted (0.4 < 0.5), bonus from row 1
    a, b = spec.chain_rejection_sample(p, d, uniforms=torch.tensor([[0.6]]))
    assert a.tolist() == [0] and b.tolist() == [0]  # rejected: residual = p_0 without token 1


def test_tau_definitions_agree():
    accepted = [0, 3, 1, 7]
    n_out = 1 + sum(x + 1 for x in accepted)  # prefill token + committed tokens
    assert spec.tau_of_rounds(accepted) == pytest.approx(sum(x + 1 for x in accepted) / 4)
    assert spec.tau_of_requests([(n_out, 4)]) == pytest.approx(spec.tau_of_rounds(accepted))
    assert spec.tau_of_rounds(accepted, n_out) == spec.tau_of_rounds(accepted)  # nothing past the output
    assert spec.tau_of_requests([(10, 0)]) is None and spec.tau_of_rounds([]) is None  # no round: undefined


@pytest.mark.parametrize("T", [0, 1, 3, 4, 9])
def test_last_rows(T):
    rows = torch.randn(2, T, 5)
    ctx, valid = spec.last_rows(rows, 4)
    n = min(4, T)
    assert valid.tolist() == [False] * (4 - n) + [True] * n
    assert torch.equal(ctx[:, 4 - n:], rows[:, T - n:]) and not ctx[:, : 4 - n].any()


def test_last_rows_of_segments_matches_per_request():
    lens = [1, 5, 3, 0, 2]
    rows = torch.randn(sum(lens), 6)
    out, valid = spec.last_rows_of_segments(rows, lens, 3)
    start = 0
    for b, n in enumerate(lens):
        ctx, v = spec.last_rows(rows[start:start + n], 3, dim=0)
        assert torch.equal(out[b], ctx) and torch.equal(valid[b], v)
        start += n


def test_filters():
    logits = torch.randn(3, 50)

    def nucleus(logits, t, top_p):  # brute force: smallest most-likely set whose mass reaches top_p
        out = torch.zeros(logits.shape)
        for r, row in enumerate(torch.softmax(logits / t, -1)):
            mass = 0.0
            for i in row.argsort(descending=True).tolist():
                if mass > top_p:
                    break
                out[r, i] = row[i]
                mass += float(row[i])
        return out / out.sum(-1, keepdim=True)

    for t, tp in [(0.7, 1.0), (1.0, 0.9), (1.3, 0.05)]:
        torch.testing.assert_close(sampling.logits_to_probs(logits, t, tp), nucleus(logits, t, tp))
    p = sampling.logits_to_probs(logits, 1.0, top_k=5)
    assert ((p > 0).sum(-1) == 5).all() and torch.allclose(p.sum(-1), torch.ones(3))
    probs = torch.softmax(torch.randn(2, 3, 20), -1)
    same = sampling.filter_top_k_top_p(probs, torch.tensor([20, 100]), torch.tensor([1.0, 1.0]))
    assert same is probs  # nothing to filter: no sort, no copy
    f = sampling.filter_top_k_top_p(probs, torch.tensor([1, 20]), torch.tensor([1.0, 0.5]))
    assert ((f[0] > 0).sum(-1) == 1).all()
    assert (f[1].sort(-1, descending=True).values.cumsum(-1)[..., 0] <= 1.0).all()


def test_roll_last_rows_is_last_rows_of_the_committed_sequence():
    """The sglang worker's carry (a fixed window rolled by each round's committed rows) equals the
    reference engine's context (the last C rows of every committed position, ``last_rows``)."""
    from sglang_dlite.drafting.context import roll_last_rows

    g = torch.Generator().manual_seed(0)
    B, C, W, D = 3, 4, 5, 2
    seq = [torch.randn(2, D, generator=g) for _ in range(B)]  # committed rows per request (prefill: 2)
    window = torch.stack([spec.last_rows(s, C, dim=0)[0] for s in seq])
    for _ in range(6):
        rows = torch.randn(B, W, D, generator=g)
        keep = torch.randint(1, W + 1, (B,), generator=g)  # accepted drafts + 1
        window = roll_last_rows(window, rows, keep)
        seq = [torch.cat([s, rows[b, : int(keep[b])]]) for b, s in enumerate(seq)]
        assert torch.equal(window, torch.stack([spec.last_rows(s, C, dim=0)[0] for s in seq]))


def test_expected_accepted_is_the_sum_of_prefix_products():
    from sglang_dlite.drafting.accept import expected_accepted, expected_accepted_prefixes

    ps = [0.5, 0.4, 0.9]
    assert expected_accepted([]) == 0.0
    assert expected_accepted(ps) == pytest.approx(0.5 + 0.2 + 0.18)
    pre = expected_accepted_prefixes(ps)
    assert pre[0] == 0.0 and pre[1] == 0.5 and pre[-1] == expected_accepted(ps) and len(pre) == len(ps) + 1
