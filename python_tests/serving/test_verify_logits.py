"""DLITE verify-time logits processing (sglang_dlite/serving/verify_logits.py), pure torch.

* Row j of a verify block gets exactly the penalties sglang's non-speculative decode applies when
  the output so far is [committed..., d_1..d_j] (brute force per row, bit for bit).
* ``commit`` adds exactly the committed tokens; ``accept`` is the longest matching prefix.
* Sampled requests with frequency / presence / repetition penalties keep the target's law: a chain
  simulated round by round (drafts, verify rows, accept, commit) on a 4-token vocabulary gives the
  same joint law of the first three tokens as sampling the penalized target token by token. The
  same simulation with the drafts left out of the row penalties (the bug this module fixes) fails.
"""

from __future__ import annotations

import itertools
import types

import torch

from sglang_dlite.serving import verify_logits as VL


def _req(freq=0.0, pres=0.0, rep=1.0, min_new=0, stop=(), eos=()):
    sp = types.SimpleNamespace(frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
                               min_new_tokens=min_new, stop_token_ids=set(stop))
    return types.SimpleNamespace(sampling_params=sp, eos_token_ids=set(eos), tokenizer=None)


def _sglang_penalized(logits, outputs, freq, pres, rep, min_new, stop):
    """sglang 0.5.23's non-speculative decode on one row: the penalizers' accumulators built one
    output token at a time (frequency: scatter_add of the penalty, presence / repetition: scatter
    of the value), additive (0 - freq - presence [+ -inf on stop tokens while fewer than
    min_new_tokens outputs]) then the repetition scaling."""
    V = logits.shape[-1]
    cf = torch.zeros(1, V)
    cp = torch.zeros(1, V)
    cr = torch.ones(1, V)
    for t in outputs:
        idx = torch.tensor([[t]])
        cf.scatter_add_(1, idx, torch.tensor([[freq]]))
        cp.scatter_(1, idx, torch.tensor([[pres]]))
        cr.scatter_(1, idx, torch.tensor([[rep]]))
    add = torch.zeros(1, V)
    add.sub_(cf)
    add.sub_(cp)
    if len(outputs) < min_new:
        for s in stop:
            add[0, s] = float("-inf")
    x = logits[None].clone() + add
    return torch.where(x < 0, x * cr, x / cr)[0]


def test_penalty_rows_equal_sglang_decode_bit_for_bit():
    torch.manual_seed(0)
    V, W = 9, 5
    reqs = [_req(freq=0.3, pres=0.7, rep=1.3), _req(), _req(freq=0.1, min_new=6, stop=(2,), eos=(3,)),
            _req(rep=0.8)]
    history = [[1, 4, 4], [5], [6, 6], [7, 1, 7, 8]]  # committed outputs, the last one is the anchor
    prompt = [10, 3, 7, 11]
    drafts = torch.tensor([[4, 4, 0, 1], [2, 3, 4, 5], [6, 2, 2, 8], [1, 1, 7, 0]])
    block = torch.cat([torch.tensor([h[-1] for h in history])[:, None], drafts], 1)
    # on_extend saw the first output; then outputs 2.. were committed round by round
    VL.on_extend(reqs, torch.tensor([h[0] for h in history]), [p for p in prompt], V)
    for r, h in zip(reqs, history):
        if len(h) > 1:
            toks = torch.tensor([h[1:] + [0] * (W - len(h) + 1)])
            VL.commit([r], toks, torch.tensor([len(h) - 2]))
    prefix_lens = torch.tensor([p + len(h) - 1 for p, h in zip(prompt, history)])  # anchor not in KV
    logits = torch.randn(4, W, V) * 3
    out = logits.clone()
    VL.apply_penalties(out, reqs, block, prefix_lens)
    for b, r in enumerate(reqs):
        sp = r.sampling_params
        stop = sorted(set(sp.stop_token_ids) | r.eos_token_ids)
        for j in range(W):
            want = _sglang_penalized(logits[b, j], history[b] + drafts[b, :j].tolist(), sp.frequency_penalty,
                                     sp.presence_penalty, sp.repetition_penalty, sp.min_new_tokens, stop)
            assert torch.equal(out[b, j], want), (b, j, out[b, j], want)
    # min_new_tokens: request 2 has 2 outputs, so rows 0..3 (outputs 3..6) ban the stop tokens
    assert torch.isinf(out[2, :4, 2]).all() and torch.isinf(out[2, :4, 3]).all()
    assert torch.isfinite(out[2, 4]).all()


def test_commit_adds_only_committed_tokens():
    V = 6
    r = _req(freq=0.5, pres=0.1)
    VL.on_extend([r], torch.tensor([3]), [4], V)
    VL.commit([r], torch.tensor([[1, 1, 5, 2]]), torch.tensor([1]))  # a = 1: tokens 1, 1 committed
    st = getattr(r, VL._STATE_ATTR)
    assert st.cnt.tolist() == [0, 2, 0, 1, 0, 0]
    assert st.cf.tolist() == [0, 1.0, 0, 0.5, 0, 0]
    VL.on_extend([r], torch.tensor([4]), [9], V)  # a new prefill (retraction) restarts, like sglang
    assert getattr(r, VL._STATE_ATTR).cnt.tolist() == [0, 0, 0, 0, 1, 0]
    plain = _req()
    VL.on_extend([plain], torch.tensor([1]), [4], V)
    assert getattr(plain, VL._STATE_ATTR, None) is None  # no state without penalties


def test_greedy_accept_is_longest_matching_prefix():
    V = 11
    target = torch.tensor([[3, 4, 5, 6, 7], [3, 9, 5, 6, 7], [1, 1, 1, 1, 2]])
    logits = torch.nn.functional.one_hot(target, V).float() * 5
    drafts = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [0, 1, 1, 1]])
    a, bonus = VL.accept(drafts, logits)
    assert a.tolist() == [4, 1, 0] and bonus.tolist() == [7, 9, 1]
    # a sampler that returns the argmax gives the same result
    a2, b2 = VL.accept(drafts, logits, lambda rows: rows.argmax(-1))
    assert a2.tolist() == a.tolist() and b2.tolist() == bonus.tolist()


# ---------------------------------------------------------------------- distribution test
V, K, W, T = 4, 3, 4, 0.9
N = 24000
PEN = dict(freq=1.0, pres=0.8, rep=2.0)
BASE = torch.tensor([[1.2, 0.9, 0.2, -0.5], [0.1, 1.1, 0.6, -0.2], [0.8, -0.3, 1.0, 0.4],
                     [0.0, 0.7, -0.4, 0.9], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, -1.0, 0.3]])
DRAFTS = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1])  # fixed (deterministic) draft chain by position


def _law_exact(n=3):
    """Joint law of the first n tokens sampled one at a time from the penalized target (the first
    one unpenalized: it is the prefill token)."""
    law = {}
    for seq in itertools.product(range(V), repeat=n):
        p = 1.0
        for t in range(n):
            x = _sglang_penalized(BASE[t], list(seq[:t]), PEN["freq"], PEN["pres"], PEN["rep"], 0, ())
            p *= float(torch.softmax(x / T, -1)[seq[t]])
        law[seq] = p
    return law


def _simulate(count_drafts=True, n=3, seed=0):
    """N requests: the prefill token, then DLITE rounds (drafts, penalized verify rows, accept,
    commit) until every request has n tokens; requests advance by their own acceptance."""
    g = torch.Generator().manual_seed(seed)
    sample = lambda rows: torch.multinomial(torch.softmax(rows / T, -1), 1, generator=g).view(-1)  # noqa: E731
    reqs = [_req(**PEN) for _ in range(N)]
    first = sample(BASE[0].expand(N, V).clone())
    VL.on_extend(reqs, first, [5] * N, V)
    outs = torch.zeros(N, n + W, dtype=torch.int64)
    outs[:, 0] = first
    L = torch.ones(N, dtype=torch.int64)  # committed outputs per request
    while bool((L < n).any()):
        act = (L < n).nonzero().view(-1)
        t0 = L[act]
        B = len(act)
        logits = BASE[(t0[:, None] + torch.arange(W)).clamp(max=len(BASE) - 1)].clone()  # [B, W, V]
        drafts = DRAFTS[t0[:, None] + torch.arange(K)]
        block = torch.cat([outs[act, t0 - 1][:, None], drafts], 1)
        sub = [reqs[i] for i in act.tolist()]
        VL.apply_penalties(logits, sub, block if count_drafts else block[:, :1].expand(B, W), 5 + t0 - 1)
        a, bonus = VL.accept(drafts, logits, sample)
        out_tok = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.int64)], 1).scatter(1, a[:, None], bonus[:, None])
        VL.commit(sub, out_tok, a)
        cols = (t0[:, None] + torch.arange(W)).clamp(max=outs.shape[1] - 1)
        keep = torch.arange(W)[None, :] <= a[:, None]
        rows = act[:, None].expand(B, W)
        outs[rows[keep], cols[keep]] = out_tok[keep]
        L[act] = t0 + a + 1
    return outs[:, :n]


def _tv(outs, law, cols):
    """Total variation between the empirical law of outs[:, cols] and the exact one."""
    n = len(cols)
    idx = (outs[:, cols] * (V ** torch.arange(n - 1, -1, -1))).sum(1)
    emp = torch.bincount(idx, minlength=V ** n).float() / len(outs)
    exact = torch.zeros(V ** n)
    for seq, p in law.items():
        exact[sum(seq[c] * V ** (n - 1 - k) for k, c in enumerate(cols))] += p
    return 0.5 * float((emp - exact).abs().sum())


def _assert_keeps_law(outs, law, what):
    """The first three tokens' joint law and the 3rd and 4th tokens' laws within tolerance of ``law``."""
    tv = [_tv(outs, law, [0, 1, 2]), _tv(outs, law, [2]), _tv(outs, law, [3])]
    print(f"{what} TV (joint of 3, 3rd token, 4th token):", tv)
    assert tv[0] < 0.03 and tv[1] < 0.015 and tv[2] < 0.015, tv


def test_sampled_penalties_keep_the_target_law():
    law = _law_exact(4)
    _assert_keeps_law(_simulate(True, n=4), law, "chain")
    # The test can fail: rows that do not count the drafts before them (sglang's relaxed
    # speculative penalties) move the third token's law well past the tolerance.
    bug = _simulate(False, n=4, seed=1)
    assert _tv(bug, law, [2]) > 0.03, _tv(bug, law, [2])


# ---------------------------------------------------------------------- per-request seeds
def _hash_uniform(seed, pos, V):
    """A stand-in for sglang's murmur_hash32(seed, position, column) -> [0, 1) (no CPU kernel)."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(pos))
    return torch.rand(V, generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)


class _SeededSampler:
    """sglang's Sampler call signature, drawing like its seeded path: Gumbel-max over the
    log-probabilities with noise from (seed, position, column)."""

    def __init__(self):
        self.calls = []

    def __call__(self, logits_output, info, return_logprob, top_logprobs_nums, token_ids_logprobs, positions):
        logits = logits_output.next_token_logits
        self.calls.append((info.sampling_seed.clone(), positions.clone()))
        logits.div_(info.temperatures)
        lp = torch.log_softmax(logits.double(), -1)
        g = torch.stack([-torch.log(-torch.log(_hash_uniform(s, p, logits.shape[-1])))
                         for s, p in zip(info.sampling_seed.tolist(), positions.tolist())])
        return (lp + g).argmax(-1)


def test_seeded_rows_draw_what_no_speculation_draws():
    """Row j of a verify block is drawn with the request's seed at the position a
    non-speculative decode uses for that token (prefix_len + j), so DLITE's tokens equal the
    no-speculation tokens for every acceptance pattern."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    torch.manual_seed(0)
    V, W, P = 7, 4, [9, 5]  # P: tokens in the KV (prompt + committed outputs before the anchor)
    table = torch.randn(20, V) * 2  # target logits by position (context-free, for the test)
    seeds = torch.tensor([11, 222])
    temps = torch.tensor([[0.7], [1.3]])
    # no speculation: token at position q+1 is drawn from table[q] with (seed, position q)
    ref = []
    for b in range(2):
        toks = []
        for q in range(P[b], P[b] + W):
            s = _SeededSampler()
            info = types.SimpleNamespace(temperatures=temps[b:b + 1], sampling_seed=seeds[b:b + 1])
            toks.append(int(s(types.SimpleNamespace(next_token_logits=table[q:q + 1].clone()), info, False,
                              None, None, torch.tensor([q]))))
        ref.append(toks)
    info = SamplingBatchInfo(temperatures=temps, top_ps=torch.ones(2), top_ks=torch.full((2,), V),
                             min_ps=torch.zeros(2), is_all_greedy=False, is_any_greedy=False,
                             need_top_p_sampling=False, need_top_k_sampling=False, need_min_p_sampling=False,
                             vocab_size=V, sampling_seed=seeds, device="cpu")
    prefix = torch.tensor(P)
    logits = torch.stack([table[p:p + W] for p in P])  # [2, W, V]
    for n_right in range(W):  # drafts right for the first n_right tokens, then wrong
        drafts = torch.tensor([[t if k < n_right else (t + 1) % V for k, t in enumerate(r[:W - 1])] for r in ref])
        sampler = _SeededSampler()
        a, bonus = VL.accept(drafts, logits.clone(), VL.sglang_row_sampler(sampler, info, W, prefix))
        seeds_used, positions = sampler.calls[0]
        assert seeds_used.tolist() == [11] * W + [222] * W
        assert positions.tolist() == [P[0] + j for j in range(W)] + [P[1] + j for j in range(W)]
        n = min(n_right, W - 1)
        assert a.tolist() == [n, n]
        assert bonus.tolist() == [ref[0][n], ref[1][n]]


# ---------------------------------------------------------------------- token trees (serving/rounds.py)
#          0 (anchor)
#        /    \
#     1 (0)   2 (1)
#      |      /   \
#    3 (1)  4 (0)  5 (2)
TREE_PARENTS = [-1, 0, 0, 1, 2, 2]
TREE_DRAFTS = [0, 1, 1, 0, 2]


def _root_path(parents, i):
    path = []
    while i > 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def test_tree_rows_get_the_penalties_of_their_root_path_bit_for_bit():
    """Node i's row = sglang's decode row after [committed..., the drafts on i's root path]: the
    chain rule applied to each root path, min_new_tokens at the node's depth; padding rows (children
    of the root) harmless."""
    torch.manual_seed(1)
    Vt = 9
    parents = [-1, 0, 0, 1, 1, 3, 2, 0]  # the last node: padding (a child of the root)
    reqs = [_req(freq=0.3, pres=0.7, rep=1.3), _req(freq=0.1, min_new=4, stop=(2,), eos=(3,)), _req()]
    history = [[1, 4, 4], [6, 6], [5]]
    prompt = [10, 3, 7]
    nodes = torch.tensor([[4, 4, 0, 1, 4, 2, 4], [2, 6, 2, 8, 6, 3, 6], [1, 2, 3, 4, 5, 6, 5]])
    block = torch.cat([torch.tensor([h[-1] for h in history])[:, None], nodes], 1)
    VL.on_extend(reqs, torch.tensor([h[0] for h in history]), prompt, Vt)
    for r, h in zip(reqs, history):
        if len(h) > 1:
            VL.commit([r], torch.tensor([h[1:] + [0] * 6]), torch.tensor([len(h) - 2]))
    prefix_lens = torch.tensor([p + len(h) - 1 for p, h in zip(prompt, history)])
    logits = torch.randn(3, len(parents), Vt) * 3
    out = logits.clone()
    par = torch.tensor([parents] * 3)
    VL.apply_penalties(out, reqs, block, prefix_lens, parents=par)
    assert VL.tree_depths(par)[0].tolist() == [0, 1, 1, 2, 2, 3, 2, 1]
    for b, r in enumerate(reqs):
        sp = r.sampling_params
        stop = sorted(set(sp.stop_token_ids) | r.eos_token_ids)
        for i in range(len(parents)):
            path = [int(block[b, j]) for j in _root_path(parents, i)]
            want = _sglang_penalized(logits[b, i], history[b] + path, sp.frequency_penalty, sp.presence_penalty,
                                     sp.repetition_penalty, sp.min_new_tokens, stop)
            assert torch.equal(out[b, i], want), (b, i)
    # min_new_tokens: request 1 has 2 outputs; nodes at depth <= 1 (outputs 3, 4) ban the stop tokens
    assert torch.isinf(out[1, [0, 1, 2, 7], 2]).all() and torch.isfinite(out[1, [3, 4, 5, 6]]).all()
    # the chain as a tree (parent j - 1) gives the chain rows
    chain = logits.clone()
    VL.apply_penalties(chain, reqs, block, prefix_lens)
    as_tree = logits.clone()
    VL.apply_penalties(as_tree, reqs, block, prefix_lens, parents=torch.arange(-1, len(parents) - 1).expand(3, -1))
    assert torch.equal(chain, as_tree)


def test_tree_links_walk_the_tree_and_leave_padding_out():
    first, sibling = VL.tree_links(torch.tensor([TREE_PARENTS + [0, 0]]), [len(TREE_PARENTS)])
    assert first[0].tolist() == [1, 3, 4, -1, -1, -1, -1, -1]
    assert sibling[0].tolist() == [-1, 2, -1, -1, 5, -1, -1, -1]


def _simulate_tree(count_tree=True, n=3, seed=0):
    """As ``_simulate`` with one token tree per round (TREE_*): node rows at BASE[depth], penalized
    over their root path (``parents``), one draw per node, the longest root path whose every token
    equals its parent's draw accepted, the bonus the draw at its end."""
    from sglang_dlite.drafting.tree import DraftTree, greedy_tree_accept

    g = torch.Generator().manual_seed(seed)
    sample = lambda rows: torch.multinomial(torch.softmax(rows / T, -1), 1, generator=g).view(-1)  # noqa: E731
    reqs = [_req(**PEN) for _ in range(N)]
    first = sample(BASE[0].expand(N, V).clone())
    VL.on_extend(reqs, first, [5] * N, V)
    R = len(TREE_PARENTS)
    par = torch.tensor(TREE_PARENTS)
    depth = VL.tree_depths(par[None])[0]
    outs = torch.zeros(N, n + R, dtype=torch.int64)
    outs[:, 0] = first
    L = torch.ones(N, dtype=torch.int64)
    while bool((L < n).any()):
        act = (L < n).nonzero().view(-1)
        t0 = L[act]
        B = len(act)
        logits = BASE[(t0[:, None] + depth).clamp(max=len(BASE) - 1)].clone()  # [B, R, V]
        block = torch.cat([outs[act, t0 - 1][:, None], torch.tensor(TREE_DRAFTS).expand(B, -1)], 1)
        sub = [reqs[i] for i in act.tolist()]
        VL.apply_penalties(logits, sub, block, 5 + t0 - 1, parents=par.expand(B, R) if count_tree else None)
        choice = sample(logits.reshape(B * R, V)).view(B, R)
        out_tok = torch.zeros(B, R, dtype=torch.int64)
        a = torch.zeros(B, dtype=torch.int64)
        for k in range(B):
            tree = DraftTree(block[k].tolist(), TREE_PARENTS)
            path, bon = greedy_tree_accept(tree, choice[k])
            committed = tree.committed(path, bon)
            out_tok[k, :len(committed)] = torch.tensor(committed)
            a[k] = len(path) - 1
        VL.commit(sub, out_tok, a)
        for k, i in enumerate(act.tolist()):
            m = int(a[k]) + 1
            outs[i, int(t0[k]):int(t0[k]) + m] = out_tok[k, :m]
        L[act] = t0 + a + 1
    return outs[:, :n]


def test_sampled_tree_rounds_with_penalties_keep_the_target_law():
    """Sampled tree rounds with frequency / presence / repetition penalties: the joint law of the
    first three tokens equals the penalized target's. Penalizing the rows as if the nodes were one
    chain (no ``parents``) moves it past the tolerance: the test can fail."""
    law = _law_exact(4)
    _assert_keeps_law(_simulate_tree(True, n=4), law, "tree")
    bug = _simulate_tree(False, n=4, seed=1)
    assert max(_tv(bug, law, [0, 1, 2]), _tv(bug, law, [2])) > 0.03


def test_seeded_tree_rows_draw_at_prefix_plus_depth():
    """A tree round's rows are drawn at position prefix_len + depth with the request's seed: with the
    no-speculation tokens on one branch and a wrong sibling before it, the committed tokens are the
    no-speculation tokens."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from sglang_dlite.drafting.tree import DraftTree, greedy_tree_accept

    torch.manual_seed(0)
    Vt, P = 7, 9
    table = torch.randn(20, Vt) * 2
    info1 = types.SimpleNamespace(temperatures=torch.tensor([[0.8]]), sampling_seed=torch.tensor([5]))
    ref = []
    for q in range(P, P + 3):
        ref.append(int(_SeededSampler()(types.SimpleNamespace(next_token_logits=table[q:q + 1].clone()), info1,
                                        False, None, None, torch.tensor([q]))))
    wrong = [(t + 1) % Vt for t in ref]
    # root -> wrong[0] (a leaf), ref[0] -> {wrong[1], ref[1]}
    tree = DraftTree((3, wrong[0], ref[0], wrong[1], ref[1]), (-1, 0, 0, 2, 2))
    depths = torch.tensor([tree.depths])
    info = SamplingBatchInfo(temperatures=torch.tensor([[0.8]]), top_ps=torch.ones(1), top_ks=torch.full((1,), Vt),
                             min_ps=torch.zeros(1), is_all_greedy=False, is_any_greedy=False,
                             need_top_p_sampling=False, need_top_k_sampling=False, need_min_p_sampling=False,
                             vocab_size=Vt, sampling_seed=torch.tensor([5]), device="cpu")
    logits = table[P + depths[0]].clone()  # context-free rows: the row of a node at depth d is table[P + d]
    sampler = _SeededSampler()
    choice = VL.sglang_row_sampler(sampler, info, len(tree), torch.tensor([P]), depths=depths)(logits)
    assert sampler.calls[0][1].tolist() == [P + d for d in tree.depths]
    path, bonus = greedy_tree_accept(tree, choice)
    assert tree.committed(path, bonus) == ref
