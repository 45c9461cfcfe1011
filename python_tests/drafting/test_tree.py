"""Tree verification (issue 46): the tree mask, tree acceptance, the KV after a tree round, and
losslessness of the reference engine with token trees (greedy: token for token; sampled: the
target's law, recursive rejection over siblings).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_dlite_config
from dlite_lab.reference.drafters import DLiteEngineDrafter, DraftRequest
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.errors import DLiteInputError
from dlite_lab.reference.drafters import TreeEngineDrafter
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.model.proposal import DraftProposal
from sglang_dlite.drafting.accept import chain_rejection_sample
from sglang_dlite.drafting.tree import (DraftTree, accept_tree, greedy_tree_accept, grow_tree,
                                           tree_rejection_sample)

EOS = 2


def random_tree(rng: random.Random, n: int, vocab: int, anchor: int = 5) -> DraftTree:
    """A random tree of n nodes (distinct sibling tokens), parents before children."""
    tokens, parents = [anchor], [-1]
    for i in range(1, n):
        while True:  # a parent with a token left for a new child
            par = rng.randrange(i)
            used = {tokens[j] for j in range(1, i) if parents[j] == par}
            if len(used) < vocab - 3:
                break
        tok = rng.choice([t for t in range(3, vocab) if t not in used])
        tokens.append(tok)
        parents.append(par)
    return DraftTree(tuple(tokens), tuple(parents))


def prompt_of(rng: random.Random, vocab: int, n: int = 12) -> list:
    return [1] + [rng.randrange(3, vocab) for _ in range(n)]


# ---------------------------------------------------------------------------- structure
def test_tree_checks_its_shape():
    with pytest.raises(DLiteInputError, match="root"):
        DraftTree((1, 2), (0, 0))
    with pytest.raises(DLiteInputError, match="topological"):
        DraftTree((1, 2, 3), (-1, 2, 0))
    with pytest.raises(DLiteInputError, match="twice"):
        DraftTree((1, 4, 4), (-1, 0, 0))
    with pytest.raises(DLiteInputError, match="one parent per node"):
        DraftTree((1, 2), (-1,))
    t = DraftTree.chain(7, [3, 4, 5])
    assert t.is_chain and t.depths == [0, 1, 2, 3] and t.path(3) == [0, 1, 2, 3]


def test_mask_is_prefix_plus_root_path():
    t = DraftTree((9, 3, 4, 5, 6), (-1, 0, 0, 1, 3))
    m = t.attention_mask(2)
    assert m.shape == (1, 1, 5, 7)
    allowed = (m[0, 0] == 0)
    assert allowed[:, :2].all()
    for i in range(5):
        assert [j for j in range(5) if allowed[i, 2 + j]] == t.path(i)
    assert t.position_ids(2).tolist() == [[2, 3, 3, 4, 5]]


def test_tree_forward_equals_a_plain_forward_of_each_root_path(tiny_target):
    """Brute force per node: the logits at node i of the one-pass tree verify equal the last
    logits of a plain forward over the committed tokens + node i's root path."""
    rng = random.Random(0)
    V = tiny_target.config.vocab_size
    eng = ReferenceEngine(tiny_target)
    for trial in range(3):
        prompt = prompt_of(rng, V, 8 + trial)
        sess = eng.new_session()
        sess.prefill(prompt[:-1])
        tree = random_tree(rng, 12, V, anchor=prompt[-1])
        with torch.no_grad():
            logits = sess.verify(list(tree.tokens), tree=tree)
            for i in range(len(tree)):
                ids = prompt[:-1] + [tree.tokens[j] for j in tree.path(i)]
                ref = tiny_target(input_ids=torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[i], ref.float(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- acceptance
def _longest_sequential_path(tree: DraftTree, target: list):
    """Verify every root path as a chain on its own; the longest accepted one (ties: impossible,
    siblings differ)."""
    best = None
    for leaf in range(len(tree)):
        path = tree.path(leaf)
        a = 0
        while a + 1 < len(path) and tree.tokens[path[a + 1]] == target[path[a]]:
            a += 1
        if best is None or a > len(best) - 1:
            best = path[:a + 1]
    return best, target[best[-1]]


def test_greedy_tree_acceptance_equals_the_longest_sequentially_verified_path():
    rng = random.Random(1)
    for _ in range(300):
        tree = random_tree(rng, rng.randrange(1, 16), 8)
        target = [rng.randrange(3, 8) for _ in range(len(tree))]
        path, bonus = greedy_tree_accept(tree, torch.tensor(target))
        assert (path, bonus) == _longest_sequential_path(tree, target)


def test_accepted_along_is_what_a_greedy_round_would_accept():
    """``DraftTree.accepted_along(stream)``: where the target continues with ``stream`` (its argmax at
    every node on that path is the stream's next token), a greedy round accepts exactly that many
    drafts; cut to the first a + 1 tokens it saturates at a + 1 (the tree held the bonus too)."""
    rng = random.Random(3)
    for _ in range(300):
        tree = random_tree(rng, rng.randrange(1, 16), 8)
        stream = [rng.randrange(3, 8) for _ in range(10)]
        depths = tree.depths
        on_stream = [[tree.tokens[j] for j in tree.path(i)[1:]] == stream[:depths[i]] for i in range(len(tree))]
        target = [stream[depths[i]] if on_stream[i] else rng.randrange(3, 8) for i in range(len(tree))]
        path, _ = greedy_tree_accept(tree, torch.tensor(target))
        a = len(path) - 1
        assert tree.accepted_along(stream) == a
        assert tree.accepted_along(stream[:a]) == a and tree.accepted_along(stream[:max(0, a - 1)]) == max(0, a - 1)
    assert DraftTree.chain(1, [4, 5, 6]).accepted_along([4, 5, 7, 6]) == 2
    assert DraftTree((1, 4, 5, 6), (-1, 0, 0, 2)).accepted_along([6]) == 0  # node 3 is not a root child


def test_a_chain_tree_accepts_as_the_chain_does():
    """Greedy: the same prefix and bonus; sampled with the same coins: the same accepted count
    (the coins of a chain and of a one-child-per-node tree are drawn in the same order)."""
    rng = random.Random(2)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        K = rng.randrange(0, 6)
        drafts = [rng.randrange(3, 6) for _ in range(K)]
        tree = DraftTree.chain(1, drafts)
        target = torch.tensor([rng.randrange(3, 6) for _ in range(K + 1)])
        a = int((torch.cumprod((torch.tensor(drafts, dtype=torch.int64) == target[:K]).long(), 0)).sum())
        path, new = accept_tree(tree, target)
        assert len(path) - 1 == a and new == drafts[:a] + [int(target[a])]
        if K:
            p = torch.softmax(torch.randn(K + 1, 6, generator=g) * 2, -1)
            u = torch.rand(K, generator=g)
            acc, _ = chain_rejection_sample(p[None], torch.tensor([drafts]), None, uniforms=u[None])
            path, _ = tree_rejection_sample(tree, p, uniforms=u.tolist() + [0.5])
            assert len(path) - 1 == int(acc[0])


def _sample_two_tokens(tree_of, p_of, n, seed=0):
    """Run rounds until two tokens are committed; the joint law of the first two tokens."""
    g = torch.Generator().manual_seed(seed)
    V = p_of(()).shape[0]
    counts = torch.zeros(V, V)
    for _ in range(n):
        out = []
        while len(out) < 2:
            tree = tree_of(tuple(out))
            p = torch.stack([p_of(tuple(out) + tuple(tree.tokens[j] for j in tree.path(i)[1:])) for i in range(len(tree))])
            _, new = accept_tree(tree, p=p, generator=g)
            out += new
        counts[out[0], out[1]] += 1
    return counts / n


def _prefix_law(V, seed):
    """A target law that depends on the last two committed tokens: a random table, filled on use."""
    g = torch.Generator().manual_seed(seed)
    table = {}

    def p_of(prefix):
        if prefix[-2:] not in table:
            table[prefix[-2:]] = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
        return table[prefix[-2:]]

    return p_of


def test_sampled_tree_keeps_the_target_distribution():
    """The target's law depends on the whole prefix (a table keyed by the committed tokens); trees
    with two and three siblings per node, chosen to cover likely and unlikely tokens. The joint law
    of the first two committed tokens must be the target's, and a broken rule (accepting each child
    with p(c) instead of the residual) must fail the same tolerance."""
    V = 4
    p_of = _prefix_law(V, seed=3)

    def tree_of(done):
        return DraftTree((0, 1, 2, 3, 0, 2, 1), (-1, 0, 0, 0, 1, 1, 2))

    emp = _sample_two_tokens(tree_of, p_of, 12000)
    want = torch.stack([p_of(())[a] * p_of((a,)) for a in range(V)])
    assert 0.5 * (emp - want).abs().sum().item() < 0.03


def test_tree_sampling_tolerance_catches_a_broken_rule(monkeypatch):
    """Accepting every child with its plain target probability p(c) (no residual) skews the law."""
    import sglang_dlite.drafting.tree as T

    def broken(tree, p, generator=None, uniforms=None):
        kids = T._child_table(tree)
        path = [0]
        while True:
            node = path[-1]
            for c in kids[node]:
                if float(torch.rand((), generator=generator)) < float(p[node, tree.tokens[c]]):
                    path.append(c)
                    break
            else:
                return path, int(torch.multinomial(p[node], 1, generator=generator))

    monkeypatch.setattr(T, "tree_rejection_sample", broken)
    V = 4
    p_of = _prefix_law(V, seed=3)

    emp = _sample_two_tokens(lambda done: DraftTree((0, 1, 2, 3, 0, 2, 1), (-1, 0, 0, 0, 1, 1, 2)), p_of, 12000)
    want = torch.stack([p_of(())[a] * p_of((a,)) for a in range(V)])
    assert 0.5 * (emp - want).abs().sum().item() > 0.03


# ---------------------------------------------------------------------------- best-first growth
def test_grow_tree_keeps_the_most_reachable_nodes():
    """Each node offers children with probabilities 0.6 / 0.3: the tree of 6 nodes holds the six
    largest reach values of the infinite tree, and the reach of each node is its path product."""
    def expand(depth):
        return [(10 + depth, 0.6, depth + 1), (20 + depth, 0.3, depth + 1)]

    tree, reach = grow_tree(1, 0, expand, 6)
    assert len(tree) == 7
    assert sorted(reach[1:], reverse=True) == pytest.approx([0.6, 0.36, 0.3, 0.216, 0.18, 0.18][:6])
    for i in range(1, len(tree)):
        assert reach[i] == pytest.approx(reach[tree.parents[i]] * (0.6 if tree.tokens[i] < 20 else 0.3))
    chain, _ = grow_tree(1, 0, lambda d: [(5 + d, 0.9, d + 1)], 4)
    assert chain.is_chain and len(chain) == 5


# ---------------------------------------------------------------------------- the engine
class TreeOracle:
    """Trees around the target's own greedy continuation: at every depth a wrong sibling first,
    the right token second (or only the wrong one, so rounds also stop early), plus a side branch."""

    def __init__(self, continuation: list, vocab: int, depth: int = 5, seed: int = 0, chain=False,
                 hidden_rows_needed=1):
        self.cont, self.vocab, self.depth, self.chain = continuation, vocab, depth, chain
        self.rng = random.Random(seed)
        self.num_drafts = 3 * depth
        self.capture_layer_ids = [0, 3]
        self.hidden_rows_needed = hidden_rows_needed

    def _tree(self, req: DraftRequest) -> DraftTree:
        n = len(req.tokens)
        want = self.cont[n:n + self.depth] if n <= len(self.cont) else []
        tokens, parents, node = [req.tokens[-1]], [-1], 0
        for d, w in enumerate(want):
            wrong = (w + 1 + self.rng.randrange(self.vocab - 4)) % self.vocab
            right = self.rng.random() < 0.8
            if not self.chain:
                tokens.append(wrong)
                parents.append(node)
            if right or self.chain:
                tokens.append(w if right else wrong)
                parents.append(node)
                node = len(tokens) - 1
            else:
                break
        return DraftTree(tuple(tokens), tuple(parents))

    def draft(self, req: DraftRequest) -> DraftProposal:
        tree = self._tree(req)
        toks = torch.tensor([tree.drafts], dtype=torch.int64).view(1, len(tree) - 1)
        return DraftProposal(toks, None, tree=None if self.chain == "as-chain" else tree)


def _greedy(target, prompt, n):
    eng = ReferenceEngine(target, None, [EOS])
    return eng.generate(prompt, n, speculative=False).output_ids


def test_rejected_branches_leave_no_kv(tiny_target):
    """After a tree round the cache covers exactly the committed tokens but the anchor, and the
    next forward's logits equal a fresh prefill's (no rejected-branch KV, positions right)."""
    rng = random.Random(4)
    V = tiny_target.config.vocab_size
    eng = ReferenceEngine(tiny_target, TreeOracle([], V, hidden_rows_needed=None), [EOS])
    prompt = prompt_of(rng, V)
    c = _greedy(tiny_target, prompt, 12)
    sess = eng.new_session()
    sess.prefill(prompt)
    sess.tokens.append(c[0])

    def wrong(t):
        return (t + 1) % V

    tree = DraftTree((c[0], wrong(c[1]), c[1], wrong(c[2]), c[2], wrong(c[3])), (-1, 0, 0, 2, 2, 4))
    with torch.no_grad():
        logits = sess.verify(list(tree.tokens), tree=tree)
        rows, new = accept_tree(tree, logits.argmax(-1))
        assert rows == [0, 2, 4] and new == c[1:4]
        sess.commit(new, len(rows), rows)
        assert sess.cache_len == len(sess.tokens) - 1 == len(prompt) + 3
        fresh = eng.new_session()
        fresh.prefill(list(sess.tokens[:-1]))
        # the captured rows: the accepted path's, contiguous, as a plain prefill captures them
        assert sess.hidden_start == 0 and sess.hidden.shape == fresh.hidden.shape
        torch.testing.assert_close(sess.hidden, fresh.hidden, atol=1e-5, rtol=1e-5)
        nxt = sess.forward([sess.tokens[-1]])[-1]
        want = fresh.forward([sess.tokens[-1]])[-1]
    torch.testing.assert_close(nxt, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chain", [False, True])
def test_tree_rounds_are_lossless_greedy(tiny_target, chain):
    rng = random.Random(5)
    V = tiny_target.config.vocab_size
    for k in range(3):
        prompt = prompt_of(rng, V, 5 + 7 * k)
        want = _greedy(tiny_target, prompt, 40)
        eng = ReferenceEngine(tiny_target, TreeOracle(prompt + want, V, seed=k, chain=chain), [EOS])
        res = eng.generate(prompt, 40)
        assert res.output_ids == want
        assert max(r.accepted for r in res.rounds) >= 2


def test_a_chain_tree_gives_todays_rounds(tiny_target):
    """The same chain verified as a tree and as today's chain: the same rounds, the same output."""
    rng = random.Random(6)
    V = tiny_target.config.vocab_size
    prompt = prompt_of(rng, V)
    want = _greedy(tiny_target, prompt, 30)
    runs = []
    for mode in (True, "as-chain"):
        eng = ReferenceEngine(tiny_target, TreeOracle(prompt + want, V, seed=1, chain=mode), [EOS])
        res = eng.generate(prompt, 30)
        runs.append((res.output_ids, [(r.draft_tokens, r.accepted) for r in res.rounds]))
    assert runs[0] == runs[1] and runs[0][0] == want


def _tiny_dlite(target, **kw):
    torch.manual_seed(0)
    return DLiteEngineDrafter(DLiteDrafter(tiny_dlite_config(target, head_input="token", **kw)).bind_hf_target(target))


@pytest.mark.parametrize("kind", ["suffix", "dlite", "hybrid"])
def test_tree_drafters_are_lossless_and_within_budget(tiny_target, kind):
    """The registry's tree drafters on a tiny target (a random DLite): greedy output identical,
    every tree within its node budget, a repetitive prompt so the lookup has branches."""
    V = tiny_target.config.vocab_size
    dl = None if kind == "suffix" else _tiny_dlite(tiny_target)
    drafter = TreeEngineDrafter(dl, lookup=kind != "dlite", num_drafts=10, branches=3)
    seen = []
    orig = drafter.draft

    def spy(req):
        prop = orig(req)
        seen.append(prop.tree)
        return prop
    drafter.draft = spy
    eng = ReferenceEngine(tiny_target, drafter, [EOS])
    rng = random.Random(7)
    unit = [rng.randrange(3, V) for _ in range(6)]
    prompt = [1] + unit * 3 + unit[:3] + [rng.randrange(3, V)] + unit * 2
    res = eng.generate(prompt, 40)
    assert res.output_ids == _greedy(tiny_target, prompt, 40)
    assert seen and all(len(t) - 1 <= 10 for t in seen)
    assert any(not t.is_chain for t in seen)


def test_sampled_engine_rounds_with_trees_run(tiny_target):
    """Temperature > 0 through the engine: recursive rejection over the tree (the law itself is
    checked above); tokens in range, rounds committed."""
    V = tiny_target.config.vocab_size
    drafter = TreeEngineDrafter(_tiny_dlite(tiny_target), lookup=True, num_drafts=8, branches=3)
    eng = ReferenceEngine(tiny_target, drafter, [EOS])
    res = eng.generate(prompt_of(random.Random(8), V), 30, temperature=0.8, seed=0)
    assert res.rounds and all(0 <= t < V for t in res.output_ids)


def test_registry_hybrid_is_the_served_tree_and_hybrid_chain_the_chain(tiny_target, tmp_path):
    """``--drafter hybrid`` drafts what the DLITE worker serves (the lookup + DLite's top-k along its
    chain, SERVED_TREE_NODES drafts), ``hybrid-chain`` today's chain hybrid; both lossless."""
    from dlite_lab.reference.drafters import HybridEngineDrafter
    from sglang_dlite.drafting.hybrid import SERVED_TREE_NODES
    from dlite_lab.registry import make_engine_drafter

    torch.manual_seed(0)
    DLiteDrafter(tiny_dlite_config(tiny_target, head_input="token")).save_pretrained(str(tmp_path / "d"))
    tree = make_engine_drafter(f"hybrid:{tmp_path / 'd'}", tiny_target)
    chain = make_engine_drafter(f"hybrid-chain:{tmp_path / 'd'}", tiny_target)
    assert isinstance(tree, TreeEngineDrafter) and tree.use_lookup and tree.branching == "chain"
    assert tree.num_drafts == SERVED_TREE_NODES == 15
    assert isinstance(chain, HybridEngineDrafter)
    V = tiny_target.config.vocab_size
    prompt = prompt_of(random.Random(3), V)
    for d in (tree, chain):
        assert ReferenceEngine(tiny_target, d, [EOS]).generate(prompt, 24).output_ids == _greedy(tiny_target, prompt, 24)
    with pytest.raises(DLiteInputError, match="hybrid-chain"):
        make_engine_drafter("hybrid-tres", tiny_target)
    # one word, ``hybrid``, for both sources: options give its other trees; the old name is refused with a hint
    head = make_engine_drafter(f"hybrid@branching=head,nodes=24:{tmp_path / 'd'}", tiny_target)
    assert head.use_lookup and head.branching == "head" and head.num_drafts == 24
    served = make_engine_drafter(f"hybrid@corpus=500:{tmp_path / 'd'}", tiny_target)
    assert (served.branching, served.num_drafts, served.corpus.max_tokens) == ("chain", SERVED_TREE_NODES, 500)
    with pytest.raises(DLiteInputError, match="renamed: use hybrid@branching=head,nodes=24"):
        make_engine_drafter(f"hybrid-tree@nodes=24:{tmp_path / 'd'}", tiny_target)


def test_lookup_continuations_count_every_earlier_continuation():
    """``SuffixIndex.continuations`` at the match: the continuations of the matched suffix and
    their counts, as a brute-force scan of the tokens finds them, most frequent first."""
    from collections import Counter

    from sglang_dlite.drafting.suffix import SuffixIndex

    rng = random.Random(9)
    for _ in range(50):
        toks = [rng.randrange(4) for _ in range(rng.randrange(5, 60))]
        idx = SuffixIndex(toks, max_match=6)
        v, m = idx.match()
        got = idx.continuations(v, m, 10)
        if v == 0:
            assert got == []
            continue
        s = toks[len(toks) - m:]
        nxt = Counter(toks[e + 1] for e in range(m - 1, len(toks) - 1) if toks[e - m + 1:e + 1] == s)
        assert {st.token: st.count for st, _ in got} == dict(nxt)
        assert all(st.total == sum(nxt.values()) and st.match_len == m for st, _ in got)
        assert [st.count for st, _ in got] == sorted(nxt.values(), reverse=True)
