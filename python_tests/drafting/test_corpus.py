"""The optional cross-request corpus (issue 46 item 5, ``drafting/corpus.py``): bounded memory with the
oldest documents evicted, per-tenant isolation, its continuations as tree branches where the
request's own index has none, off by default (today's trees exactly), lossless greedy in the
reference engine with it on, the DLITE worker's ``BatchLookup`` feeding it as requests leave."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_dlite_config
from dlite_lab.reference.drafters import DLiteEngineDrafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.drafting.hybrid import BatchLookup
from sglang_dlite.drafting.chooser import CORPUS_CONTESTED_SCALE, default_calibration
from sglang_dlite.drafting.corpus import CorpusView, SharedCorpus
from sglang_dlite.drafting.suffix import LookupStep, SuffixIndex
from sglang_dlite.drafting.hybrid import grow_round_tree
from dlite_lab.reference.drafters import TreeEngineDrafter
from sglang_dlite.model.dlite import DLiteDrafter

EOS = 2


def doc(rng: random.Random, n: int, lo: int = 1000, hi: int = 60000) -> list:
    return [rng.randrange(lo, hi) for _ in range(n)]


def corpus_tokens_after(corpus: SharedCorpus, context: list, tenant=None, k: int = 4) -> list:
    """The corpus's continuations (tokens) of a request whose tokens are ``context``."""
    view = corpus.view(SuffixIndex(context), tenant)
    return [s.token for s, _ in view.continuations(*view.match(), k) if s.corpus]


# ---------------------------------------------------------------------------- the corpus
def test_budget_is_held_and_the_oldest_documents_go():
    rng = random.Random(0)
    corpus = SharedCorpus(max_tokens=400, segments=4)  # segments of 100 tokens
    docs = [doc(rng, 30) for _ in range(30)]
    for d in docs:
        corpus.add(d)
        assert corpus.num_tokens <= 400
    assert corpus.stats["evicted_segments"] > 0 and corpus.memory_bytes() > 0
    assert corpus_tokens_after(corpus, docs[-1][:10]) == [docs[-1][10]]  # the newest: held
    assert corpus_tokens_after(corpus, docs[0][:10]) == []  # the oldest: evicted
    held = [i for i, d in enumerate(docs) if corpus_tokens_after(corpus, d[:10]) == [d[10]]]
    assert held == list(range(held[0], len(docs)))  # a suffix of the documents, newest kept
    assert 400 // 31 - 4 <= len(held) <= 400 // 31


def test_a_document_longer_than_a_segment_keeps_its_newest_tokens():
    rng = random.Random(1)
    corpus = SharedCorpus(max_tokens=200, segments=2)
    d = doc(rng, 500)
    corpus.add(d)
    assert corpus.num_tokens <= 200
    assert corpus_tokens_after(corpus, d[480:490]) == [d[490]]
    assert corpus_tokens_after(corpus, d[:10]) == []


def test_a_continued_document_adds_its_tail_and_a_repeat_adds_nothing():
    rng = random.Random(2)
    corpus = SharedCorpus(max_tokens=100_000, max_match=16)
    turn1 = doc(rng, 200)
    turn2 = turn1 + doc(rng, 50)  # a conversation's next request: the first one + more
    assert corpus.add(turn1) == 200
    assert corpus.add(turn2) == 16 + 50  # the tail after the last max_match tokens of the first
    assert corpus.add(turn2) == 0 and corpus.add(turn1) == 0  # held: nothing twice
    assert corpus.stats == {"documents": 2, "tokens_added": 266, "duplicates": 2, "continued": 1,
                            "evicted_segments": 0}
    assert corpus_tokens_after(corpus, turn2[195:205]) == [turn2[205]]  # across the join


def test_tenants_are_isolated():
    rng = random.Random(3)
    corpus = SharedCorpus(max_tokens=10_000)
    a, b = doc(rng, 40), doc(rng, 40)
    corpus.add(a, tenant="A")
    corpus.add(b)  # the default tenant
    assert corpus_tokens_after(corpus, a[:12], tenant="A") == [a[12]]
    assert corpus_tokens_after(corpus, a[:12], tenant="B") == []
    assert corpus_tokens_after(corpus, a[:12]) == []
    assert corpus_tokens_after(corpus, b[:12]) == [b[12]]
    assert corpus_tokens_after(corpus, b[:12], tenant="A") == []


def test_short_matches_and_separators_are_never_branches():
    corpus = SharedCorpus(max_tokens=1000, min_match=4)
    corpus.add([10, 11, 12, 13, 14])
    assert corpus_tokens_after(corpus, [7, 12, 13]) == []  # a 2-token match: below min_match
    assert corpus_tokens_after(corpus, [11, 12, 13, 14]) == []  # the document's end: no separator
    assert corpus_tokens_after(corpus, [10, 11, 12, 13]) == [14]


def test_the_incremental_match_equals_a_fresh_one():
    """The per-request cursor (advanced round to round, resynced when the corpus changes) gives the
    match a fresh view computes from scratch, while documents arrive and segments are evicted."""
    rng = random.Random(4)
    corpus = SharedCorpus(max_tokens=600, segments=3, max_match=8, min_match=2)
    base = doc(rng, 60, 5, 40)  # a small vocabulary: many partial matches
    own, cursor = SuffixIndex(base[:5], max_match=8), {}
    for step in range(300):
        if rng.random() < 0.1:
            corpus.add(doc(rng, rng.randrange(5, 80), 5, 40))
        own.append(rng.randrange(5, 40) if rng.random() < 0.5 else base[step % 60])
        got = corpus.view(own, cursor=cursor).match()
        assert got == corpus.view(own).match()


def test_contested_corpus_steps_are_scored_below_the_requests_own():
    cal = default_calibration()
    own, corp = LookupStep(5, 3, 4, 8), LookupStep(5, 3, 4, 8, corpus=True)
    contested = LookupStep(5, 3, 4, 8, corpus=True, contested=True)
    assert cal.p_lookup(corp) == cal.p_lookup(own)  # where the request's own tokens say nothing
    assert cal.p_lookup(contested) == pytest.approx(CORPUS_CONTESTED_SCALE * cal.p_lookup(own))


# ---------------------------------------------------------------------------- trees
def test_corpus_continuations_branch_a_tree_the_own_index_cannot():
    rng = random.Random(5)
    earlier = doc(rng, 60)
    ctx = doc(rng, 30) + earlier[:20]  # this request ends as the earlier one went on
    cal = default_calibration()
    alone, _, src = grow_round_tree(ctx[-1], SuffixIndex(ctx), None, cal, 4, 10)
    assert len(alone) == 1 and src == "none"
    corpus = SharedCorpus(10_000)
    corpus.add(earlier)
    tree, _, src = grow_round_tree(ctx[-1], corpus.view(SuffixIndex(ctx)), None, cal, 4, 10)
    assert src == "corpus" and list(tree.drafts[:3]) == earlier[20:23]


def test_the_requests_own_continuations_come_first():
    rng = random.Random(6)
    unit = doc(rng, 8)
    ctx = unit + [7] + unit[:6]  # the own index continues unit[:6] with unit[6]
    other = unit[:6] + [9, 9, 9]  # the corpus with 9
    corpus = SharedCorpus(10_000)
    corpus.add(other)
    view = corpus.view(SuffixIndex(ctx))
    steps = [s for s, _ in view.continuations(*view.match(), 4)]
    assert [(s.token, s.corpus, s.contested) for s in steps] == [(unit[6], False, False), (9, True, True)]
    own = SuffixIndex(ctx)
    assert [s for s, _ in own.continuations(*own.match(), 4)] == steps[:1]


def test_an_empty_corpus_gives_todays_trees():
    rng = random.Random(7)
    unit = doc(rng, 6, 3, 50)
    ctx = [1] + unit * 3 + unit[:3] + [rng.randrange(3, 50)] + unit * 2 + unit[:2]
    cal = default_calibration()
    want = grow_round_tree(ctx[-1], SuffixIndex(ctx), None, cal, 3, 12)
    got = grow_round_tree(ctx[-1], SharedCorpus(1000).view(SuffixIndex(ctx)), None, cal, 3, 12)
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2]


# ---------------------------------------------------------------------------- reference engine
def _tiny_dlite(target):
    torch.manual_seed(0)
    return DLiteEngineDrafter(DLiteDrafter(tiny_dlite_config(target, head_input="token")).bind_hf_target(target))


def test_off_by_default(tiny_target, tmp_path):
    from dlite_lab.registry import make_engine_drafter
    from sglang_dlite.settings import ServingOptions

    assert TreeEngineDrafter(None).corpus is None
    DLiteDrafter(tiny_dlite_config(tiny_target, head_input="token")).save_pretrained(str(tmp_path / "d"))
    assert make_engine_drafter(f"hybrid:{tmp_path / 'd'}", tiny_target).corpus is None
    assert make_engine_drafter(f"hybrid@branching=head:{tmp_path / 'd'}", tiny_target).corpus is None
    on = make_engine_drafter(f"hybrid@corpus=5000:{tmp_path / 'd'}", tiny_target)
    assert on.corpus.max_tokens == 5000 and on.branching == "chain" and on.num_drafts == 15
    tree = make_engine_drafter(f"hybrid@nodes=8,corpus=700:{tmp_path / 'd'}", tiny_target)
    assert (tree.num_drafts, tree.corpus.max_tokens) == (8, 700)
    assert make_engine_drafter("suffix-tree@corpus=0", tiny_target).corpus is None
    for bad in (f"hybrid@branching=every:{tmp_path / 'd'}", f"dlite-tree@corpus=100:{tmp_path / 'd'}", "suffix-tree@corpus=x"):
        with pytest.raises(DLiteInputError):
            make_engine_drafter(bad, tiny_target)
    assert ServingOptions().corpus_tokens == 0 and BatchLookup(7).corpus is None


def test_engine_with_the_corpus_is_lossless_and_branches_from_it(tiny_target, monkeypatch):
    """Greedy requests in a row through one engine with the corpus on: every output is the target's
    own, only speculative requests feed the corpus, and later requests get corpus branches."""
    V = tiny_target.config.vocab_size
    offered = []
    orig = CorpusView.continuations

    def spy(self, *a, **kw):
        out = orig(self, *a, **kw)
        offered.append(sum(s.corpus for s, _ in out))
        return out
    monkeypatch.setattr(CorpusView, "continuations", spy)
    drafter = TreeEngineDrafter(_tiny_dlite(tiny_target), lookup=True, num_drafts=15, branching="chain",
                                corpus=SharedCorpus(20_000))
    eng = ReferenceEngine(tiny_target, drafter, [EOS])
    plain = ReferenceEngine(tiny_target, None, [EOS])
    rng = random.Random(9)
    shared = [rng.randrange(3, V) for _ in range(24)]
    for i in range(1, 4):  # requests sharing a block of content, never the same request
        prompt = [1] + [rng.randrange(3, V) for _ in range(6 + i)] + shared
        want = plain.generate(prompt, 40, speculative=False).output_ids
        if i == 1:  # an earlier document that went on otherwise after the same context
            drafter.corpus.add(shared[-8:] + want[:1] + [t for t in range(3, V) if t not in want][:30])
        assert drafter.corpus.stats["documents"] == i  # the target-alone runs feed nothing
        assert eng.generate(prompt, 40).output_ids == want
    assert drafter.corpus.stats["documents"] == 4
    assert sum(offered) > 0


# ---------------------------------------------------------------------------- the DLITE worker's lookup
def _req(rid, tokens, tenant=None):
    params = SimpleNamespace(custom_params=None if tenant is None else {"dlite_tenant": tenant})
    return SimpleNamespace(rid=rid, origin_input_ids=list(tokens), output_ids=[], sampling_params=params)


def test_batch_lookup_feeds_the_corpus_as_requests_leave():
    rng = random.Random(10)
    first, other = doc(rng, 50), doc(rng, 10)
    bl = BatchLookup(7, corpus_tokens=10_000)
    r1, r2, r3 = _req("r1", first), _req("r2", other + first[:15]), _req("r3", other + first[:15], "T")
    bl.on_extend([r1])
    idxs, _, _ = bl.begin_round([r1], [first[-1]], lookup=False)  # a tree round's indices
    assert isinstance(idxs[0], CorpusView) and bl.corpus.num_tokens == 0
    bl.commit([r1], idxs, [[5, 6]], [2])
    assert bl.states["r1"].tokens[-3:] == [first[-1], 5, 6]  # upkeep went to the own index
    bl.on_extend([r2, r3])
    idxs, _, _ = bl.begin_round([r2, r3], [first[15], first[15]], lookup=False)  # r1 left
    assert "r1" not in bl.states and bl.corpus.stats["documents"] == 1
    got = [[s.token for s, _ in v.continuations(*v.match(), 4) if s.corpus] for v in idxs]
    assert got == [[first[16]], []]  # r3's tenant never sees the default tenant's documents
    idxs, lookups, _ = bl.begin_round([r2, r3], [first[16], first[16]])  # a chain round: own indices
    assert all(isinstance(i, SuffixIndex) for i in idxs)
    bl.retain([])
    assert bl.corpus.stats["documents"] == 3 and not bl.cursors and not bl.tenants


def test_batch_lookup_without_the_corpus_is_unchanged():
    bl = BatchLookup(7)
    r = _req("r", [1, 2, 3, 1, 2])
    bl.on_extend([r])
    idxs, _, _ = bl.begin_round([r], [3], lookup=False)
    assert type(idxs[0]) is SuffixIndex and not bl.tenants
    bl.retain([])
    assert not bl.states


def test_the_serving_setting():
    from sglang_dlite.settings import ServingOptions

    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"corpus_tokens": 200000}'})
    assert o.corpus_tokens == 200_000 and json.loads(o.describe())["corpus_tokens"] == 200_000
    assert "corpus_tokens" not in json.loads(ServingOptions.from_env({}).describe())
    for bad in ('{"corpus_tokens": -1}', '{"corpus_tokens": "big"}', '{"corpus_tokens": true}',
                '{"corpus_tokens": 1000, "lookup": false}'):
        with pytest.raises(DLiteConfigError, match="corpus_tokens"):
            ServingOptions.from_env({"SGLANG_DLITE_CONFIG": bad})
