"""Online adaptation (``sglang_dlite/drafting/online.py``, issue 47) on tiny random-weight models: it learns a
planted repetitive stream, the watchdog reverts a worse adapter, per-session state starts from the
shipped weights and is freed with its session, the output stays the target's greedy output, the
shipped drafter is never written, and a seed makes a run reproducible."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import tiny_dlite_config
from dlite_lab.reference.drafters import DLiteEngineDrafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from dlite_lab.reference.drafters import HybridEngineDrafter
from dlite_lab.reference.drafters import TreeEngineDrafter
from sglang_dlite.model.dlite import DLiteDrafter
from dlite_lab.ablations import AblationDrafter
from sglang_dlite.drafting.online import STATE_KEY, OnlineConfig, OnlineLearner, chain_accepted
from dlite_lab.reference.drafters import OnlineDrafter
from dlite_lab.registry import served_hybrid

EOS = 2
# a tiny random target continues this prompt with one token repeated: the planted stream
REPETITIVE = [1, 5, 9, 13, 5, 9, 13, 5, 9, 13]


def shipped(target, seed=0, **kw):
    torch.manual_seed(seed)
    return DLiteDrafter(tiny_dlite_config(target, head_input="token", **kw)).bind_hf_target(target)


def online_engine(target, model, hybrid=None, **opts):
    """DLite alone (``hybrid`` None), the chain hybrid ("chain") or the served tree ("tree") over a learner."""
    learner = OnlineLearner(model, OnlineConfig(**opts), drafts_are_model=hybrid is None)
    inner = DLiteEngineDrafter(learner.model)
    if hybrid:
        inner = served_hybrid(inner, chain=hybrid == "chain")
    return ReferenceEngine(target, OnlineDrafter(inner, learner), [EOS]), learner


def hf_greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_update_moves_the_drafter_towards_the_target(tiny_target):
    """On a repetitive stream: the loss on the collected pairs falls, acceptance rises above the
    static drafter's (which accepts ~nothing: random weights)."""
    model = shipped(tiny_target)
    static = ReferenceEngine(tiny_target, DLiteEngineDrafter(model), [EOS]).generate(REPETITIVE, 120)
    # collect pairs without learning, then learn on them
    eng, learner = online_engine(tiny_target, model, params="head", update_every=10**6, buffer_size=64)
    sess = eng.new_session()
    eng.generate(REPETITIVE, 60, session=sess)
    st = sess.drafter_state[STATE_KEY]
    pairs = list(st.buffer)
    with torch.no_grad():
        before = float(learner.loss(pairs))
    for _ in range(5):
        learner.update(st)
    with torch.no_grad():
        after = float(learner.loss(pairs))
    assert after < 0.7 * before, (before, after)
    eng, learner = online_engine(tiny_target, model, params="head")
    adaptive = eng.generate(REPETITIVE, 120)
    assert adaptive.output_ids == static.output_ids
    assert adaptive.tau > static.tau + 1.0, (static.tau, adaptive.tau)
    second_half = adaptive.rounds[len(adaptive.rounds) // 2:]
    assert sum(r.accepted for r in second_half) / len(second_half) > 1.0
    assert learner.stats["updates"] > 0 and learner.stats["reverts"] == 0


@pytest.mark.parametrize("every", [1, 0])  # 0: the server scope's default, one round in 8 compared
def test_watchdog_reverts_a_worse_adapter(tiny_target, every):
    """A shipped drafter that accepts well, an adapter made worse (the final norm negated): the
    watchdog sees the adapted chain lose on a window of compared rounds (every round, or one in 8)
    and goes back to the shipped weights."""
    eng, first = online_engine(tiny_target, shipped(tiny_target), params="head")
    eng.generate(REPETITIVE, 80)  # first.model now drafts the stream well: the "shipped" drafter below
    good = first.model
    eng, learner = online_engine(tiny_target, good, params="norm", scope="server", update_every=10**6,
                                 watchdog_window=4, watchdog_every=every)
    n = learner.cfg.watch_every
    assert n == (every or 8)
    st = learner._server
    st.values["final_norm.weight"].mul_(-1)
    st.adapted = True
    res = eng.generate(REPETITIVE, 60 if n == 1 else 150)
    assert learner.stats["reverts"] == 1
    assert learner.stats["watched"] == 4  # the window's 4 compared rounds (one in n), none after the revert
    assert torch.equal(st.values["final_norm.weight"], good.final_norm.weight)
    assert torch.equal(learner.model.final_norm.weight, good.final_norm.weight)
    assert not st.adapted
    late = res.rounds[4 * n + 4:]
    assert sum(r.accepted for r in late) / len(late) > 1.0  # drafting well again after the revert


def test_session_state_starts_from_shipped_and_is_freed_with_its_session(tiny_target):
    model = shipped(tiny_target)
    eng, learner = online_engine(tiny_target, model, params="head")
    s1 = eng.new_session()
    eng.generate(REPETITIVE, 80, session=s1)
    st1 = s1.drafter_state[STATE_KEY]
    assert st1.adapted
    head = lambda m: m.head.out_proj.weight.detach().clone()  # noqa: E731
    assert not torch.equal(head(learner.model), head(model))
    s2 = eng.new_session()
    eng.generate([1, 7, 11], 2, session=s2)  # one round: a fresh state, no update yet
    assert s2.drafter_state[STATE_KEY] is not st1
    assert torch.equal(head(learner.model), head(model))  # the new conversation drafts with shipped weights
    ref = weakref.ref(st1)
    del s1, st1
    gc.collect()
    assert ref() is None  # nothing of the finished conversation is kept
    assert learner.stats["sessions"] == 2


@pytest.mark.parametrize("hybrid", [None, "chain", "tree"])
@pytest.mark.parametrize("scope", ["session", "server"])
def test_lossless_with_adaptation_on(tiny_target, hybrid, scope):
    """Greedy output with adaptation on == the target's own greedy output (float32), over the turns
    of a conversation (one session) and on random prompts."""
    eng, learner = online_engine(tiny_target, shipped(tiny_target), hybrid=hybrid, params="last", scope=scope,
                                 update_every=2)
    sess = eng.new_session()
    prompt = list(REPETITIVE)
    for turn in range(3):
        res = eng.generate(prompt, 40, session=sess)
        assert res.output_ids == hf_greedy(tiny_target, prompt, 40)
        prompt = prompt + res.output_ids + [7 + turn, 3, 21]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        p = [1] + torch.randint(3, tiny_target.config.vocab_size, (12,), generator=g).tolist()
        assert eng.generate(p, 30).output_ids == hf_greedy(tiny_target, p, 30)
    assert learner.stats["updates"] > 0


def test_tree_rounds_teach_their_accepted_path(tiny_target):
    """The served tree (``hybrid-online``): each round's pair is the chain of its accepted root path
    -- the feedback is the path's drafts, the labels the committed tokens (path + bonus), as a chain
    round over the same tokens would give -- and learning keeps the output the target's."""
    eng, learner = online_engine(tiny_target, shipped(tiny_target), hybrid="tree", params="head",
                                 update_every=10**6, buffer_size=10**4)
    assert isinstance(eng.drafter.inner, TreeEngineDrafter)
    sess = eng.new_session()
    res = eng.generate(REPETITIVE, 60, session=sess)
    assert res.output_ids == hf_greedy(tiny_target, REPETITIVE, 60)
    pairs = list(sess.drafter_state[STATE_KEY].buffer)
    assert len(pairs) == len(res.rounds) and any(r.accepted > 0 for r in res.rounds)
    K, vi, pos = learner.model.config.block_size, learner._vocab_index, 1  # output_ids[0]: the prefill's token
    stream = hf_greedy(tiny_target, REPETITIVE, 60 + 2 * K)  # the last round may commit past the limit
    for pair, rnd in zip(pairs, res.rounds):
        committed = stream[pos:pos + rnd.accepted + 1]
        pos += rnd.accepted + 1
        n = min(rnd.accepted, K)
        assert pair.feedback[:n].tolist() == committed[:n]
        want = vi[torch.tensor(committed[:min(rnd.accepted + 1, K)])].tolist()
        assert pair.labels[:len(want)].tolist() == want
        assert (pair.labels[len(want):] == -1).all()


def test_online_registry_names(tiny_target, tmp_path):
    """``--drafter hybrid-online`` learns under the served tree, ``hybrid-chain-online`` under the
    chain hybrid, ``dlite-online`` alone; every one drafts from the learner's working copy."""
    from dlite_lab.registry import make_engine_drafter

    torch.manual_seed(0)
    DLiteDrafter(tiny_dlite_config(tiny_target, head_input="token")).save_pretrained(str(tmp_path / "d"))
    kinds = {"hybrid-online": TreeEngineDrafter, "hybrid-chain-online": HybridEngineDrafter,
             "dlite-online": DLiteEngineDrafter}
    for name, kind in kinds.items():
        d = make_engine_drafter(f"{name}:{tmp_path / 'd'}@lr=1e-3", tiny_target)
        assert isinstance(d, OnlineDrafter) and isinstance(d.inner, kind) and d.learner.cfg.lr == 1e-3
        inner = d.inner if kind is DLiteEngineDrafter else d.inner.dlite
        assert inner.model is d.learner.model
    with pytest.raises(DLiteInputError, match="hybrid-chain-online"):
        make_engine_drafter("hybrid-onlin", tiny_target)


def test_shipped_weights_unchanged(tiny_target):
    model = shipped(tiny_target)
    before = params_of(model)
    for params in ("head", "last"):
        eng, learner = online_engine(tiny_target, model, params=params, scope="server")
        eng.generate(REPETITIVE, 60)
        assert learner.stats["updates"] > 0
    after = params_of(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert learner.model.embed_weight is model.embed_weight  # the target's frozen tensors are shared


def test_deterministic_with_a_seed(tiny_target):
    def run(seed):
        eng, learner = online_engine(tiny_target, shipped(tiny_target), params="last", seed=seed, batch_size=4,
                                     update_every=2)
        res = eng.generate(REPETITIVE[:5] + [40, 41, 40, 41], 80)
        return [r.draft_tokens for r in res.rounds], learner.model.head.out_proj.weight.detach().clone()

    (d1, w1), (d2, w2) = run(0), run(0)
    assert d1 == d2 and torch.equal(w1, w2)


def test_chain_accepted_judges_other_chains_conservatively():
    target = [5, 6, 7, 8]  # the target's token at each verify row of drafts [5, 6, 9]
    assert chain_accepted([5, 6, 9], [5, 6, 9], target) == 2  # the verified chain: exact
    assert chain_accepted([5, 6, 7, 1], [5, 6, 9], target) == 3  # accepted at row 2, later rows judged [5, 6, 9]
    assert chain_accepted([4, 6], [5, 6, 9], target) == 0
    assert chain_accepted([5, 6, 9, 8], [5, 6, 9], [5, 6, 9, 8]) == 4


def test_bad_settings_say_what_is_wrong(tiny_target):
    with pytest.raises(DLiteConfigError, match="params"):
        OnlineConfig(params="everything")
    with pytest.raises(DLiteConfigError, match="scope"):
        OnlineConfig(scope="galaxy")
    with pytest.raises(DLiteInputError, match="key=value"):
        OnlineConfig.parse("lr")
    with pytest.raises(DLiteInputError, match="not a"):
        OnlineConfig.parse("steps=many")
    assert OnlineConfig.parse("params=head, scope=server,lr=1e-2,max_update_ms=none") == OnlineConfig(
        params="head", scope="server", lr=1e-2)
    with pytest.raises(DLiteConfigError, match="token-fed"):
        OnlineLearner(AblationDrafter(tiny_dlite_config(tiny_target, head_input="hidden")).bind_hf_target(tiny_target))


def test_update_budget_caps_the_steps(tiny_target):
    """``max_update_ms``: an update stops stepping once past its budget (here 0 ms: one step each)."""
    eng, learner = online_engine(tiny_target, shipped(tiny_target), params="head", steps=50, max_update_ms=0.0)
    eng.generate(REPETITIVE, 40)
    s = learner.summary()
    assert s["updates"] > 0 and s["steps"] == s["updates"] == s["budget_cut"]
    assert s["learn_ms_per_round"] >= s["update_ms_per_round"] > 0


def test_tree_gate_judges_the_tree_it_did_not_verify(tiny_target):
    """The tree gate (``OnlineLearner.tree_gate``): once adapted, each judged round (every round per
    session: ``watch_every`` 1) grows the adapted and the shipped tree, verifies one, and records which
    would have accepted more. Every verdict equals the truth: where the
    target continues with its own greedy stream, the tree not verified accepts ``accepted_along(stream)``
    drafts; the verdict is the sign of that against the verified tree's count."""
    eng, learner = online_engine(tiny_target, shipped(tiny_target), hybrid="tree", params="last", update_every=2,
                                 lr=3e-2, tree_gate=10**4)
    d = eng.drafter
    assert d.gated and d.inner.dlite.model is learner.model and not learner.watch_paths
    log, observe = [], d.observe
    d.observe = lambda req, *a, **k: (log.append(d._gate), observe(req, *a, **k))
    sess = eng.new_session()
    res = eng.generate(REPETITIVE, 120, session=sess)
    stream = hf_greedy(tiny_target, REPETITIVE, 120 + 2 * 16)
    assert res.output_ids == stream[:120]
    want, pos = [], 1  # output_ids[0]: the prefill's token
    for gate, rnd in zip(log, res.rounds):
        if gate is not None:
            adapted, shipped_tree, use = gate
            assert rnd.draft_tokens == (adapted if use else shipped_tree).drafts
            other = (shipped_tree if use else adapted).accepted_along(stream[pos:])
            sign = (other > rnd.accepted) - (other < rnd.accepted)
            want.append(-sign if use else sign)
        pos += rnd.accepted + 1
    st = sess.drafter_state[STATE_KEY]
    assert want and list(st.gate) == want
    s = learner.summary()
    assert s["gate_adapted"] + s["gate_shipped"] == len(want)
    assert s["gate_better"] == want.count(1) and s["gate_worse"] == want.count(-1)


def test_backoff_learns_one_tree_round_in_n_while_the_gate_drafts_the_shipped_tree(tiny_target):
    """``backoff`` in the reference engine: once adapted, a round drafted while the gate's record is not
    in favour of the adapted tree is learned from one in ``backoff`` (the first such round, then one in
    ``backoff``; no inputs kept, no pair, no update count in the others), every round otherwise; output
    stays the target's."""
    eng, learner = online_engine(tiny_target, shipped(tiny_target), hybrid="tree", params="last", update_every=2,
                                 lr=3e-2, backoff=3)
    d = eng.drafter
    draft, want, got = d.draft, [], []

    def spy(req):  # the rule, stated apart from the code: which rounds must be learned
        st = learner.state_for(req.state)
        held = st.adapted and sum(st.gate) <= 0
        spy.run = spy.run + 1 if held else 0
        want.append(not held or spy.run % 3 == 1)
        before = learner.stats["rounds"]
        prop = draft(req)
        got.append(before)
        return prop
    spy.run = 0
    d.draft = spy
    observe = d.observe
    d.observe = lambda req, *a, **k: (observe(req, *a, **k), got.__setitem__(-1, learner.stats["rounds"] > got[-1]))
    res = eng.generate(REPETITIVE, 120, session=eng.new_session())
    assert res.output_ids == hf_greedy(tiny_target, REPETITIVE, 120)
    assert got == want and want.count(False) == learner.stats["backed_off"] > 0
    assert learner.stats["rounds"] == want.count(True)


def test_tree_gate_verifies_the_winning_tree(tiny_target):
    """The gate drafts the adapted tree while its record over the window is positive, else the shipped
    tree; ``tree_gate=0`` (or DLite alone / the chain hybrid) grows one tree, no gate."""
    eng, learner = online_engine(tiny_target, shipped(tiny_target), hybrid="tree", params="last", update_every=2)
    d = eng.drafter
    sess = eng.new_session()
    eng.generate(REPETITIVE, 40, session=sess)
    st = sess.drafter_state[STATE_KEY]
    assert st.adapted
    from dlite_lab.reference.drafters import DraftRequest
    req = DraftRequest(tokens=sess.tokens, hidden=sess.hidden, hidden_start=sess.hidden_start, temperature=0.0,
                       top_p=1.0, generator=None, state=sess.drafter_state)
    for record, use in (([1, 1, -1], True), ([1, -1], False), ([], False), ([-1, 0], False)):
        st.gate.clear()
        st.gate.extend(record)
        prop = d.draft(req)
        adapted, shipped_tree, used = d._gate
        assert used is use and prop.tree is (adapted if use else shipped_tree)
        assert adapted.drafts == d.inner.grow(req, learner.model).tree.drafts
        assert shipped_tree.drafts == d.inner.grow(req, learner.shipped).tree.drafts
    # the verdict on the tree not verified, from what the round committed ([4, 5] + bonus 6: 2 accepted)
    from sglang_dlite.drafting.tree import DraftTree
    holds_all, holds_one, holds_two = (DraftTree((9, 4, 5, 6), (-1, 0, 1, 2)), DraftTree.chain(9, [4, 7]),
                                       DraftTree.chain(9, [4, 5, 8]))
    logits = torch.zeros(3, tiny_target.config.vocab_size)
    for adapted, shipped_tree, use, verdict in ((holds_all, holds_two, False, 1), (holds_one, holds_two, False, -1),
                                                (holds_two, holds_all, True, -1), (holds_two, holds_one, True, 1),
                                                (holds_two, holds_two, True, 0)):
        st.gate.clear()
        d._gate = (adapted, shipped_tree, use)
        d.observe(req, [4, 5], logits, 2, path=True, committed=[4, 5, 6])
        assert list(st.gate) == [verdict] and d._gate is None
    for hybrid, opts in (("tree", {"tree_gate": 0}), ("chain", {}), (None, {})):
        e, _ = online_engine(tiny_target, shipped(tiny_target), hybrid=hybrid, **opts)
        assert not e.drafter.gated and e.drafter.learner.watch_paths == (opts.get("tree_gate", 32) == 0)
    with pytest.raises(DLiteConfigError, match="tree_gate"):
        OnlineConfig(tree_gate=-1)

