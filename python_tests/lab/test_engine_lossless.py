"""The reference engine is lossless: greedy speculative output == the target's own greedy output.

Checked with an untrained DLite drafter (tau ~ 1: every round rejects early), with a drafter that
proposes the target's own continuation (multi-token acceptance on every round), with the history
variants, and across the turns of multi-turn conversations that reuse the target's KV.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_dlite_config
from dlite_lab.reference.drafters import DLiteEngineDrafter, DraftRequest, OracleDrafter
from dlite_lab.ablations import build_drafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.proposal import DraftProposal

EOS = 2


def hf_greedy(target, prompt, n):
    """Ground truth: transformers' own greedy generate (no cache tricks of ours)."""
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
        pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt):].tolist()


def prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def dlite(target, **kw):
    torch.manual_seed(0)
    return build_drafter(tiny_dlite_config(target, **kw)).bind_hf_target(target)


@pytest.mark.parametrize("variant", [
    {},
    {"block_attention": "causal", "num_context_positions": 1},
    {"history": "full"},
    {"history": "window:8"},
    {"head_input": "hidden", "block_size": 7},
])
def test_untrained_dlite_is_lossless(tiny_target, variant):
    eng = ReferenceEngine(tiny_target, DLiteEngineDrafter(dlite(tiny_target, **variant)), [EOS])
    for p in prompts(10 if not variant else 4, tiny_target.config.vocab_size):
        ref = hf_greedy(tiny_target, p, 24)
        res = eng.generate(p, 24)
        assert res.output_ids == ref
        assert all(1 <= r.committed <= eng.drafter.num_drafts + 1 for r in res.rounds)
    eng.close()


def test_oracle_drafter_accepts_whole_blocks_and_stays_lossless(tiny_target):
    ps = prompts(10, tiny_target.config.vocab_size, seed=1)
    refs = [hf_greedy(tiny_target, p, 30) for p in ps]
    table = {tuple(p + r): None for p, r in zip(ps, refs)}
    eng = ReferenceEngine(tiny_target, OracleDrafter(table, num_drafts=5), [EOS])
    taus = []
    for p, ref in zip(ps, refs):
        res = eng.generate(p, 30)
        assert res.output_ids == ref
        # All drafts are right, so every round commits K + 1 = 6 tokens (the last one past the limit
        # too); τ counts the returned tokens after the prefill's: (len - 1) / rounds.
        assert all(r.committed == 6 for r in res.rounds)
        assert res.tau == pytest.approx((len(ref) - 1) / len(res.rounds))
        taus.append(res.tau)
    # 30 tokens without an EOS: the prefill's + 29 in 5 rounds (6 + 6 + 6 + 6 + 5 returned) = 5.8.
    assert max(taus) == pytest.approx(29 / 5)
    assert min(taus) > 4.0


class _Corrupting:
    """Wraps a drafter and flips its j-th proposal: exercises partial acceptance at every depth."""

    def __init__(self, inner, vocab):
        self.inner, self.vocab, self.calls = inner, vocab, 0
        self.num_drafts = inner.num_drafts
        self.capture_layer_ids = inner.capture_layer_ids
        self.hidden_rows_needed = inner.hidden_rows_needed

    def draft(self, req: DraftRequest) -> DraftProposal:
        prop = self.inner.draft(req)
        j = self.calls % self.num_drafts
        self.calls += 1
        toks = prop.tokens.clone()
        toks[0, j] = (toks[0, j] + 1) % self.vocab
        return DraftProposal(toks, None)


def test_batch_of_requests_of_different_lengths(tiny_target):
    ps = prompts(5, tiny_target.config.vocab_size, seed=4)
    eng = ReferenceEngine(tiny_target, DLiteEngineDrafter(dlite(tiny_target)), [EOS])
    outs = eng.generate_batch(ps, 10)
    assert [o.output_ids for o in outs] == [hf_greedy(tiny_target, p, 10) for p in ps]


def test_partial_acceptance_at_every_depth(tiny_target):
    ps = prompts(4, tiny_target.config.vocab_size, seed=2)
    refs = [hf_greedy(tiny_target, p, 40) for p in ps]
    table = {tuple(p + r): None for p, r in zip(ps, refs)}
    drafter = _Corrupting(OracleDrafter(table, num_drafts=4), tiny_target.config.vocab_size)
    eng = ReferenceEngine(tiny_target, drafter, [EOS])
    seen = set()
    for p, ref in zip(ps, refs):
        res = eng.generate(p, 40)
        assert res.output_ids == ref
        seen |= {r.accepted for r in res.rounds}
    assert {0, 1, 2, 3} <= seen


def test_multi_turn_session_reuses_kv_and_stays_lossless(tiny_target):
    """A conversation: each turn = previous context + reply + a new user message."""
    V = tiny_target.config.vocab_size
    for variant in ({}, {"history": "full"}, {"history": "window:4"}):
        eng = ReferenceEngine(tiny_target, DLiteEngineDrafter(dlite(tiny_target, **variant)), [EOS])
        rng = random.Random(3)
        sess = eng.new_session()
        ctx = [1] + [rng.randrange(3, V) for _ in range(12)]
        for turn in range(4):
            res = eng.generate(ctx, 12, session=sess)
            assert res.output_ids == hf_greedy(tiny_target, ctx, 12)
            if turn:
                assert res.reused_prefix > 0  # the target KV of earlier turns was reused
            # Continue with a "recorded" reply that differs from the generated one half the time.
            reply = res.output_ids if turn % 2 else [rng.randrange(3, V) for _ in range(5)]
            ctx = ctx + reply + [rng.randrange(3, V) for _ in range(rng.randrange(1, 6))]
        eng.close()


def test_engine_rejects_bad_input(tiny_target):
    eng = ReferenceEngine(tiny_target, DLiteEngineDrafter(dlite(tiny_target)), [EOS])
    with pytest.raises(DLiteInputError, match="empty prompt"):
        eng.generate([], 4)
    with pytest.raises(DLiteInputError, match="over the target's limit"):
        eng.generate([1] * tiny_target.config.max_position_embeddings, 4)
    with pytest.raises(DLiteInputError, match="max_new_tokens"):
        eng.generate([1, 5], 0)
    eng.close()
    bad = dlite(tiny_target)
    bad.config.target_layer_ids = [99]
    with pytest.raises(DLiteInputError, match="has 6 layers"):
        ReferenceEngine(tiny_target, DLiteEngineDrafter(bad), [EOS])


def test_generation_stops_at_limit_and_eos(tiny_target):
    prompt = [1, 7, 8, 9]
    ref = hf_greedy(tiny_target, prompt, 9)
    eng = ReferenceEngine(tiny_target, OracleDrafter({tuple(prompt + ref): None}, 7), [EOS])
    assert eng.generate(prompt, 9).output_ids == ref  # the limit falls inside a round
    # Declare a token the target emits mid-block as EOS: generation stops right after it.
    eos = ref[2]
    eng2 = ReferenceEngine(tiny_target, OracleDrafter({tuple(prompt + ref): None}, 7), [eos])
    out = eng2.generate(prompt, 9).output_ids
    assert out == ref[: ref.index(eos) + 1]


def test_real_target_lossless(real_target):
    """The bundled SmolLM2-135M-Instruct: DLite (untrained or shipped) and the oracle drafter."""
    from dlite_lab.commands.generate import chat_ids
    from sglang_dlite.model.dlite import load_dlite

    model, tok = real_target
    eos = [tok.eos_token_id]
    texts = ["What is the capital of France?", "Write a Python function that reverses a list."]
    ids = [chat_ids(tok, t) for t in texts]
    refs = []
    for p in ids:
        out = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long), eos_token_id=eos)
        refs.append(out[0, len(p):].tolist())
    eng = ReferenceEngine(model, DLiteEngineDrafter(load_dlite(None, model)), eos)
    for p, ref in zip(ids, refs):
        assert eng.generate(p, 20).output_ids == ref
    eng.close()
    orc = ReferenceEngine(model, OracleDrafter({tuple(p + r): None for p, r in zip(ids, refs)}, 7), eos)
    for p, ref in zip(ids, refs):
        res = orc.generate(p, 20)
        assert res.output_ids == ref and res.tau > 3


class _RecordingContext:
    """Proposes with ``inner`` but records what a DLite drafter would read this round: the
    anchor position and the context rows (``DLiteEngineDrafter.context_inputs``)."""

    def __init__(self, inner, dlite_adapter):
        self.inner, self.adapter = inner, dlite_adapter
        self.num_drafts = inner.num_drafts
        self.capture_layer_ids = dlite_adapter.capture_layer_ids
        self.hidden_rows_needed = dlite_adapter.hidden_rows_needed
        self.seen = []

    def draft(self, req: DraftRequest) -> DraftProposal:
        ctx, valid, _, offset = self.adapter.context_inputs(req)
        self.seen.append((list(req.tokens), ctx[0].clone(), valid[0].clone(), int(offset)))
        prop = self.inner.draft(req)
        return DraftProposal(prop.tokens[:, : self.num_drafts], None)


@pytest.mark.parametrize("corrupt", [False, True])
def test_drafter_context_equals_teacher_forced_hidden_states_every_round(tiny_target, corrupt):
    """Regression: the engine once bounded its hidden-state buffer while the verify block was
    appended, so after the first round the drafter saw no context at all (tau ~1, still lossless).
    Every round, the context rows must be the target's hidden states at positions n-C..n-1 of a
    plain teacher-forced forward over the same tokens (n = the anchor's position)."""
    V = tiny_target.config.vocab_size
    d = DLiteEngineDrafter(dlite(tiny_target))
    C = d.model.config.num_context_positions
    ps = prompts(3, V, seed=5)
    refs = [hf_greedy(tiny_target, p, 30) for p in ps]
    oracle = OracleDrafter({tuple(p + r): None for p, r in zip(ps, refs)}, num_drafts=4)
    inner = _Corrupting(oracle, V) if corrupt else oracle
    rec = _RecordingContext(inner, d)
    eng = ReferenceEngine(tiny_target, rec, [EOS])
    rounds = []
    for p in ps:
        rounds += eng.generate(p, 30).rounds
    sess = eng.new_session()
    ctx = list(ps[0])
    for turn in range(3):  # later turns reuse the session's KV (prefix cache)
        res = eng.generate(ctx, 30, session=sess)
        rounds += res.rounds
        ctx = ctx + res.output_ids + ps[(turn + 1) % 3][1:8]
    assert len(rec.seen) > 10
    accepted = {r.accepted for r in rounds}
    assert {0, 4} <= accepted if not corrupt else {0, 1, 2, 3} <= accepted
    layer_ids = d.capture_layer_ids
    for tokens, got, valid, offset in rec.seen:
        n = len(tokens) - 1  # the anchor (bonus token) has no hidden state yet
        with torch.no_grad():
            hs = tiny_target(torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states
        want = torch.stack([hs[i + 1][0] for i in layer_ids])  # [L, n, H]
        m = min(C, n)
        assert offset == n - C
        assert valid.tolist() == [False] * (C - m) + [True] * m
        torch.testing.assert_close(got[:, C - m:], want[:, n - m:], rtol=1e-4, atol=1e-4)
    eng.close()
