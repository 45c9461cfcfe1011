"""Self-speculative regeneration (training/spec_regen.py) on tiny random-weight Llamas: the text is
the float32 target's greedy text (HF, batch 1, turn by turn), token for token, with rows that
finish at different times, drafts accepted and rejected; the features are HF's hidden states;
``FastLlama.verify`` equals ``decode`` step by step."""

from __future__ import annotations

import pytest
import torch

from test_fast_regen import LAYERS, _convs, _fast, hf_greedy_conv, tiny  # noqa: F401  (fixture)

from dlite_lab.training.fast_llama import FastLlama
from dlite_lab.training.spec_regen import SpecRegenerator


def _spec(model, eos, batch_size, num_drafts=4, min_reach=0.0, max_new=24, max_len=256, layers=LAYERS,
          continue_truncated=False, fixed_rows=24.0, dtype=torch.float32, attention="auto"):
    return _fast(model, eos, batch_size, max_new=max_new, max_len=max_len, dtype=dtype, layers=layers,
                 continue_truncated=continue_truncated, cls=SpecRegenerator, attention=attention,
                 num_drafts=num_drafts, min_reach=min_reach, max_match=32, fixed_rows=fixed_rows)


@pytest.mark.parametrize("batch_size,num_drafts,fixed_rows,attention", [
    (1, 4, 24.0, "auto"), (3, 3, None, "auto"), (16, 6, 24.0, "auto"), (3, 3, None, "sdpa")])
def test_spec_text_equals_hf_fp32_greedy(tiny, batch_size, num_drafts, fixed_rows, attention):
    """Same sequences and masks as HF batch-1 float32 greedy decoding; drafts were both accepted
    and rejected; rows finished at different steps (EOS turns, room limits, 1-3 turns); verify
    attention by the C++ kernel (auto, when built) or chunked SDPA."""
    convs, eos = _convs(tiny, 9)
    fr = _spec(tiny, eos, batch_size, num_drafts=num_drafts, max_new=40, fixed_rows=fixed_rows, attention=attention)
    seqs, masks, feats = fr.run(convs)
    for c, s, m in zip(convs, seqs, masks):
        assert (s, m) == hf_greedy_conv(tiny, c, eos, fr.turns.max_new, fr.turns.max_len), f"conversation {c['id']} differs"
    st = fr.summary()
    assert st["accepted"] >= 10, st  # multi-token commits happened ...
    assert st["accepted"] < st["drafted"], st  # ... and rejections
    assert fr.new_tokens == sum(sum(m) for m in masks)
    assert st["steps"] < fr.new_tokens / min(batch_size, len(convs))  # fewer passes than one token each
    assert sum(1 for s, m in zip(seqs, masks) for j in range(len(s)) if s[j] == eos and m[j]) >= 2
    assert len({sum(m) for m in masks}) > 3  # rows of different lengths


def test_spec_continue_truncated_and_max_len(tiny):
    """A turn cut by max_new_tokens (drafts must never run past the room) and max_len."""
    convs, eos = _convs(tiny, 6, seed=5)
    fr = _spec(tiny, eos, 3, num_drafts=5, max_new=7, continue_truncated=True)
    seqs, masks, _ = fr.run(convs)
    for c, s, m in zip(convs, seqs, masks):
        assert (s, m) == hf_greedy_conv(tiny, c, eos, 7, fr.turns.max_len, continue_truncated=True)
    convs, eos = _convs(tiny, 4, seed=4)
    fr = _spec(tiny, eos, 2, num_drafts=5, max_new=40, max_len=70)
    for c, s, m in zip(convs, *fr.run(convs)[:2]):
        assert (s, m) == hf_greedy_conv(tiny, c, eos, 40, 70)


def test_spec_features_equal_hf_hidden_states(tiny):
    convs, eos = _convs(tiny, 5, seed=1)
    fr = _spec(tiny, eos, 2, max_new=30)
    seqs, masks, feats = fr.run(convs)
    assert fr.stats["accepted"] > 0
    for s, f in zip(seqs, feats):
        assert f.shape == (len(s) - 1, len(LAYERS) + 1, tiny.config.hidden_size)
        with torch.no_grad():
            hs = tiny(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states
        ref = torch.stack([hs[l + 1][0] for l in LAYERS] + [hs[-1][0]], 1)[: len(s) - 1]
        torch.testing.assert_close(f.float(), ref.to(torch.float16).float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_verify_equals_decode(tiny, attention):
    """verify with rows of 1..4 tokens == the same tokens decoded one step at a time, one token per
    slot (auto: the C++ kernel's verify against chunked SDPA's steps; sdpa: SDPA against itself)."""
    torch.manual_seed(0)
    V = tiny.config.vocab_size
    prompts = [torch.randint(3, V, (n,)).tolist() for n in (5, 17, 9)]
    nxt = [torch.randint(3, V, (n,)).tolist() for n in (4, 3, 1)]
    a, b = FastLlama(tiny, 3, 64, capture_layers=[1], attention=attention), FastLlama(tiny, 3, 64, capture_layers=[1], attention="sdpa")
    for e in (a, b):
        e.k.fill_(float("nan"))
        e.v.fill_(float("nan"))
        for s, p in enumerate(prompts):
            e.extend(s, p, 0, False)
    ids = torch.tensor([t for x in nxt for t in x])
    na, fa = a.verify(ids, [len(p) for p in prompts], [len(x) for x in nxt], True)
    outs = [[] for _ in prompts]
    for step in range(max(len(x) for x in nxt)):
        live = [s for s in range(3) if step < len(nxt[s])]
        assert live == list(range(len(live)))  # rows with more tokens come first here
        n, f = b.verify(torch.tensor([nxt[s][step] for s in live]), [len(prompts[s]) + step for s in live], [1] * len(live), True)
        for j, s in enumerate(live):
            outs[s].append((n[j], f[j]))
    flat = [o for s in range(3) for o in outs[s]]
    torch.testing.assert_close(na, torch.stack([o[0] for o in flat]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fa.float(), torch.stack([o[1] for o in flat]).float(), atol=2e-3, rtol=2e-3)


def test_select_draft_budget_vs_brute_force(tiny):
    """_select takes a prefix of every chain and maximizes expected tokens per row-unit
    (B + sum of reaches) / (fixed_rows + B + drafts) over all prefix choices (brute force)."""
    import itertools
    import random

    fr = _spec(tiny, 0, 1)
    rng = random.Random(0)
    for trial in range(200):
        B = rng.randint(1, 4)
        cands = []
        for b in range(B):
            reach, c = 1.0, []
            for j in range(rng.randint(0, 3)):
                reach *= rng.choice([1.0, 0.9, 0.6, 0.3])
                c.append((100 * b + j, reach))
            cands.append(c)
        fr.fixed_rows = rng.choice([0.0, 2.0, 8.0, 24.0])
        got = fr._select(cands)
        assert all(g == [t for t, _ in c[:len(g)]] for g, c in zip(got, cands))

        def value(ns):
            return (B + sum(r for c, n in zip(cands, ns) for _, r in c[:n])) / (fr.fixed_rows + B + sum(ns))

        best = max(value(ns) for ns in itertools.product(*[range(len(c) + 1) for c in cands]))
        assert value([len(g) for g in got]) >= best - 1e-9, (cands, fr.fixed_rows, got)
    fr.fixed_rows = None
    assert fr._select([[(1, 0.1), (2, 0.05)], []]) == [[1, 2], []]


def test_spec_bf16_runs_and_relabel_makes_it_greedy(tiny):
    """gen-data --dtype bfloat16 with --spec-drafts: runs; after the relabel cut every generated
    token is the float32 target's greedy choice."""
    from dlite_lab.training.exactness import count_disagreements, reference_greedy, relabel

    convs, eos = _convs(tiny, 4, seed=3)
    fr = _spec(tiny, eos, 4, max_new=30, dtype=torch.bfloat16)
    seqs, masks, _ = fr.run(convs)
    assert fr.stats["accepted"] > 0
    out_s, out_m, _, _ = relabel(tiny, seqs, masks)
    preds, _ = reference_greedy(tiny, out_s)
    assert all(count_disagreements(s, m, p) == 0 for s, m, p in zip(out_s, out_m, preds))


def test_fixed_rows_follow_the_attention_path(tiny):
    """The step-cost model's default: per-slot attention (the C++ kernel) leaves a larger fixed
    share than chunked SDPA, whose cost grows with the verified rows."""
    from dlite_lab.training.spec_regen import FIXED_ROWS

    _, eos = _convs(tiny, 1)
    for attention in ("auto", "sdpa"):
        fr = _fast(tiny, eos, 2, cls=SpecRegenerator, attention=attention, num_drafts=4, min_reach=0.3)
        want = FIXED_ROWS["kernel" if fr.engine.kernel_attention else "sdpa"]
        assert fr.fixed_rows == want
        fr = _fast(tiny, eos, 2, cls=SpecRegenerator, attention=attention, num_drafts=4, min_reach=0.3, fixed_rows=-1)
        assert fr.fixed_rows is None
    assert FIXED_ROWS["kernel"] > FIXED_ROWS["sdpa"]
