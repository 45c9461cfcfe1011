"""Suffix lookup drafting: the suffix index vs brute force, the chooser, and hybrid drafting in
the reference engine (lossless, greedy and sampled)."""

from __future__ import annotations

import random
import types
from typing import Sequence

import pytest

from sglang_dlite.drafting.suffix import SuffixIndex


# the index's oracles: what it must answer, by brute force
def brute_force_match(tokens: Sequence[int], max_match: int) -> int:
    """Length of the longest suffix (<= max_match) that also ends at an earlier position."""
    n = len(tokens)
    best = 0
    for L in range(1, min(max_match, n - 1) + 1):
        suf = list(tokens[n - L:])
        if any(list(tokens[e - L + 1:e + 1]) == suf for e in range(L - 1, n - 1)):
            best = L
        else:
            break
    return best


def brute_force_continuations(tokens: Sequence[int], pattern: Sequence[int]) -> dict:
    """{next token: count} over every earlier occurrence of ``pattern`` followed by a token."""
    L = len(pattern)
    out: dict = {}
    pat = list(pattern)
    for s in range(0, len(tokens) - L):
        if list(tokens[s:s + L]) == pat:
            t = tokens[s + L]
            out[t] = out.get(t, 0) + 1
    return out


def _strings(seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(30):
        n = rng.randint(1, 160)
        kind = rng.random()
        if kind < 0.3:  # random over a small alphabet (many repeats)
            s = [rng.randint(0, 3) for _ in range(n)]
        elif kind < 0.6:  # random over a larger alphabet (few repeats)
            s = [rng.randint(0, 50) for _ in range(n)]
        else:  # periodic with noise (long repeats: exercises the match cap)
            period = [rng.randint(0, 9) for _ in range(rng.randint(1, 7))]
            s = [period[i % len(period)] if rng.random() > 0.05 else rng.randint(0, 9) for i in range(n)]
        out.append(s)
    out.append([7] * 150)  # one long run: link paths as deep as the cap allows
    return out


@pytest.mark.parametrize("max_match", [1, 3, 8, 64])
def test_match_and_continuations_equal_brute_force(max_match):
    for s in _strings(max_match):
        idx = SuffixIndex(max_match=max_match)
        for i, t in enumerate(s):
            idx.append(t)
            pre = s[: i + 1]
            v, m = idx.match()
            assert m == brute_force_match(pre, max_match), (pre, max_match)
            if m:
                cont = brute_force_continuations(pre, pre[-m:])
                got = {c: idx.cnt[w] for c, w in idx.nxt[v].items()}
                assert got == cont, (pre, m)
                tok, _, n, total = idx._best(v)  # the stored best continuation, O(1)
                assert total == sum(cont.values()) and n == max(cont.values()) == cont[tok]


@pytest.mark.parametrize("max_match", [4, 64])
def test_propose_steps_are_most_frequent_continuations(max_match):
    for s in _strings(100 + max_match):
        idx = SuffixIndex(s, max_match=max_match)
        draft = idx.propose(7)
        chain = []
        for step in draft.steps:
            ctx = s + chain
            pattern = ctx[-step.match_len:]
            cont = brute_force_continuations(s, pattern)
            assert cont, (s, chain, step)
            assert step.total == sum(cont.values())
            assert step.count == max(cont.values()) == cont[step.token]
            chain.append(step.token)
        if brute_force_match(s, max_match) > 0:
            assert len(draft.steps) > 0


def test_sync_is_incremental_and_rebuilds_on_divergence():
    s = [1, 2, 3, 1, 2, 3, 1, 2]
    idx = SuffixIndex(s[:4])
    assert idx.sync(s) is False and idx.tokens == s
    assert idx.propose(3).tokens == [3, 1, 2]
    assert idx.sync([5, 6, 5]) is True and idx.tokens == [5, 6, 5]
    assert idx.propose(1).tokens == [6]


def test_quoted_continuation_is_proposed_in_full():
    quote = list(range(100, 140))
    idx = SuffixIndex([1, 2] + quote + [3, 4] + quote[:10])
    d = idx.propose(7)
    assert d.tokens == quote[10:17]
    assert all(st.count == 1 and st.total == 1 for st in d.steps)


# ---------------------------------------------------------------------------- chooser
from types import SimpleNamespace  # noqa: E402

from sglang_dlite.drafting.chooser import Calibration, best_chain, candidates, expected_accepted, lookup_only  # noqa: E402


def choose(idx, k, cal, dlite_tokens, dlite_conf):
    """The hybrid's choice for one request (``BatchLookup``'s rule): every candidate chain, then the
    best, with the best score of each source."""
    cands = candidates(idx, k, cal, dlite_tokens, dlite_conf)
    c = best_chain(cands, cal)
    scores = {"suffix": cands[0].score(), "dlite": next((x.score() for x in cands if x.alone), None),
              "mixed": max((x.score() for x in cands if x.split > 0 and not x.alone), default=None)}
    return SimpleNamespace(tokens=c.tokens, source=c.source, score=c.score(), split=c.split, scores=scores)


def test_expected_accepted_is_sum_of_prefix_products():
    assert expected_accepted([]) == 0
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)


def test_chooser_picks_lookup_on_a_quoted_continuation_and_dlite_on_novel_text():
    cal = Calibration()  # the prior: frequency shrunk by match length; DLite's own confidence
    quote = list(range(100, 160))
    # quoted: the context repeats a 60-token span and is 20 tokens into the second copy
    idx = SuffixIndex([1, 2] + quote + [3, 4] + quote[:20])
    c = choose(idx, 7, cal, dlite_tokens=[9, 9, 9, 9, 9, 9, 9], dlite_conf=[0.4] * 7)
    assert c.source == "suffix" and c.tokens == quote[20:27]
    assert c.score > c.scores["dlite"]
    # novel text: nothing repeats, DLite is confident
    idx = SuffixIndex(list(range(200, 260)))
    c = choose(idx, 7, cal, dlite_tokens=[5, 6, 7, 8, 9, 10, 11], dlite_conf=[0.9] * 7)
    assert c.source == "dlite" and c.tokens == [5, 6, 7, 8, 9, 10, 11]


def test_chooser_continues_dlite_with_the_lookup_when_prefixes_agree():
    cal = Calibration()
    quote = list(range(100, 140))
    # the anchor (7) is new, DLite's first draft re-enters the quote: the lookup continues it
    idx = SuffixIndex([1] + quote + [2, 7])
    c = choose(idx, 7, cal, dlite_tokens=[100, 50, 51, 52, 53, 54, 55], dlite_conf=[0.95, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2])
    assert c.source == "mixed" and c.split == 1
    assert c.tokens == [100] + quote[1:7]


def test_chain_longer_than_dlite_is_continued_by_the_lookup():
    """k > DLite's K (sglang's --speculative-num-draft-tokens above K + 1): the lookup alone runs
    k long, DLite's K drafts are continued by the lookup where they re-enter a quote, and DLite
    alone stays K long."""
    cal = Calibration()
    quote = list(range(100, 160))
    idx = SuffixIndex([1, 2] + quote + [3, 4] + quote[:20])
    c = choose(idx, 12, cal, dlite_tokens=[9] * 7, dlite_conf=[0.4] * 7)
    assert c.source == "suffix" and c.tokens == quote[20:32]
    # DLite's 7 drafts follow the quote: the lookup continues them to 12
    c = choose(idx, 12, cal, dlite_tokens=quote[20:27], dlite_conf=[0.99] * 7)
    assert c.tokens == quote[20:32] and c.source in ("suffix", "mixed")
    assert c.scores["mixed"] is not None and c.scores["mixed"] > c.scores["dlite"]
    # novel text: DLite alone, K long (nothing to continue it with)
    idx = SuffixIndex(list(range(200, 260)))
    c = choose(idx, 12, cal, dlite_tokens=[5, 6, 7, 8, 9, 10, 11], dlite_conf=[0.9] * 7)
    assert c.source == "dlite" and c.tokens == [5, 6, 7, 8, 9, 10, 11]


def test_min_reach_cuts_the_chain():
    from types import SimpleNamespace
    from sglang_dlite.drafting.hybrid import BatchLookup
    for min_reach, pad, want in ((0.05, False, [0, 1]), (0.05, True, [0, 1, 1, 1, 1, 1, 1]), (0.0, False, list(range(7)))):
        bl = BatchLookup(7, Calibration(), min_reach=min_reach)
        req = SimpleNamespace(rid="r", get_fill_ids=lambda: list(range(200, 259)))
        bl.on_extend([req])
        conf = [0.9, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1]
        drafts, sources, probs = bl.draft_round([req], [259], None, lambda: ([list(range(7))], [conf]), pad=pad)
        assert drafts == [want] and sources == ["dlite"]  # reach after 3 drafts: 0.9 * 0.5 * 0.1 < 0.05
        assert len(probs[0]) == (2 if min_reach else 7)


# ---------------------------------------------------------------------------- reference engine
import torch  # noqa: E402

from conftest import make_tiny_llama, tiny_dlite_config  # noqa: E402
from dlite_lab.reference.drafters import DLiteEngineDrafter  # noqa: E402
from dlite_lab.reference.engine import ReferenceEngine  # noqa: E402
from dlite_lab.reference.drafters import HybridEngineDrafter, SuffixEngineDrafter  # noqa: E402
from sglang_dlite.model.dlite import DLiteDrafter  # noqa: E402

EOS = 2


# An untrained DLite is (over)confident on a tiny random target: calibrate it as accepted 30 %.
UNTRAINED = Calibration(dlite={f"{b}:{a}": 0.3 for b in range(10) for a in range(3)})


def _hybrid(target, **kw):
    torch.manual_seed(0)
    m = DLiteDrafter(tiny_dlite_config(target, block_size=5)).bind_hf_target(target)
    return HybridEngineDrafter(DLiteEngineDrafter(m), calibration=UNTRAINED, **kw)


def _repetitive_prompts(vocab, n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 20))]
        out.append([1] + span + [rng.randrange(3, vocab)] + span + span[: rng.randrange(1, len(span))])
    return out


@pytest.mark.parametrize("which", ["hybrid", "suffix", "hybrid-cut", "hybrid-long"])
def test_lookup_drafters_are_lossless_greedy(tiny_target, which):
    cap = 12 if which == "hybrid-long" else 5  # hybrid-long: chains past DLite's K=5, lookup-continued
    if which == "suffix":
        dr = SuffixEngineDrafter(num_drafts=5)
    else:
        dr = _hybrid(tiny_target, min_reach=0.3 if which == "hybrid-cut" else 0.0,
                     num_drafts=12 if which == "hybrid-long" else None)
    eng = ReferenceEngine(tiny_target, dr, [EOS])
    sess = eng.new_session()
    sources, accepted, longest = set(), 0, 0
    hist = []
    for p in _repetitive_prompts(tiny_target.config.vocab_size, n=4):
        ref = eng.generate(p, 40, speculative=False).output_ids
        res = eng.generate(p, 40)
        assert res.output_ids == ref
        # multi-turn: the session's index continues across turns that extend the context
        hist = hist + p[1:] + ref
        turn = eng.generate([1] + hist, 16, session=sess)
        assert turn.output_ids == eng.generate([1] + hist, 16, speculative=False).output_ids
        hist += turn.output_ids
        for r in res.rounds + turn.rounds:
            sources.add(r.source)
            accepted += r.accepted
            assert len(r.draft_tokens) <= cap
            longest = max(longest, r.accepted)
    assert accepted > 0
    if which == "hybrid-long":
        assert longest > 5, longest  # a round accepted more drafts than DLite alone could make
    assert sources & {"suffix", "mixed"}  # the lookup drafted (the tiny target's output repeats)
    eng.close()


def test_hybrid_sampling_keeps_target_distribution():
    """Empirical law of the second output token (the first one a round drafts) with hybrid
    drafting at temperature 0.8 vs the target's exact law, on an 8-token vocabulary."""
    from sglang_dlite.model.sampling import logits_to_probs

    target = make_tiny_llama(seed=3, vocab=8, hidden=32, layers=2)
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6]
    eng = ReferenceEngine(target, _hybrid(target), [])
    T, N = 0.8, 1500
    with torch.no_grad():
        p0 = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], T)
        exact = torch.zeros(8)
        for x0 in range(8):
            p1 = logits_to_probs(target(torch.tensor([prompt + [x0]])).logits[0, -1], T)
            exact += p0[x0] * p1
    counts = torch.zeros(8)
    drafted = 0
    for s in range(N):
        res = eng.generate(prompt, 3, temperature=T, seed=s)
        counts[res.output_ids[1]] += 1
        drafted += sum(r.accepted for r in res.rounds)
    tv = 0.5 * (counts / N - exact).abs().sum().item()
    assert drafted > N // 10  # drafts really were accepted
    assert tv < 0.05, tv
    eng.close()


# ---------------------------------------------------------------------------- serving state
from sglang_dlite.drafting.hybrid import BatchLookup  # noqa: E402


class _Req:
    def __init__(self, rid, toks):
        self.rid, self.toks = rid, list(toks)

    def get_fill_ids(self):
        return self.toks


def test_batch_lookup_follows_the_batch_and_frees_finished_requests():
    bl = BatchLookup(4, calibration=Calibration())
    a, b, c = _Req("a", [1, 2, 3, 4, 1, 2]), _Req("b", [9, 8, 7, 9, 8]), _Req("c", [5, 6])
    bl.on_extend([a, b])
    assert len(bl) == 2
    # draft_round (what the worker calls): begin_round, the candidates, pick_round at n = K (DLite
    # "ran" and drafted nothing: the lookup's chains only)
    drafts, _, _ = bl.draft_round([a, b], [3, 7], None, lambda: (None, None))
    assert drafts[0][:3] == [4, 1, 2] and bl._round[2][0] == "suffix"
    assert all(len(d) == 4 for d in drafts)
    # pick_round gives each real chain's calibrated probabilities too (not padded)
    idxs = bl._round[0]
    cands = bl.round_candidates(idxs, [lookup_only(i, 4, bl.cal) for i in idxs])
    drafts2, sources2, probs = bl.pick_round(idxs, cands, 4)
    assert (drafts2, sources2) == (drafts, bl._round[2])
    assert len(probs) == 2 and all(0.0 <= p <= 1.0 for ps in probs for p in ps)
    assert len(probs[0]) >= 3  # a: the quoted continuation 4 1 2 ...
    assert bl.commit_round([a, b], [2, 0]) == sources2 and bl.commit_round([a, b], [0, 0]) is None
    assert bl.states["a"].tokens == [1, 2, 3, 4, 1, 2, 3, 4, 1]  # + anchor + 2 accepted
    assert bl.states["b"].tokens == [9, 8, 7, 9, 8, 7]
    assert sum(bl.source_rounds.values()) == 2 and bl.source_rounds["suffix"] >= 1
    # a new request joins (merge), b finished or was aborted: it is not in the next decode batch
    bl.on_extend([c])
    assert len(bl) == 3
    bl.draft_round([a, c], [2, 6], None, lambda: (None, None))
    assert sorted(bl.states) == ["a", "c"]
    bl.commit_round([a, c], [0, 0])
    bl.begin_round([c], anchors=[5])
    assert sorted(bl.states) == ["c"]


@pytest.mark.parametrize("variant", [{"head_input": "hidden"}, {}])
def test_dlite_confidence_is_the_softmax_of_its_greedy_draft(tiny_target, variant):
    from dlite_lab.ablations import build_drafter

    torch.manual_seed(0)
    m = build_drafter(tiny_dlite_config(tiny_target, **variant)).bind_hf_target(tiny_target).eval()
    cfg = m.config
    ctx = torch.randn(3, cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size)
    valid = torch.ones(3, cfg.num_context_positions, dtype=torch.bool)
    anchor = torch.tensor([4, 5, 6])
    fused = m.propose(ctx, valid, anchor)
    withc = m.propose(ctx, valid, anchor, return_confidence=True)
    assert torch.equal(fused.tokens, withc.tokens)
    with torch.no_grad():
        if m.config.head_input == "token":
            logits = m(ctx, valid, anchor, feedback_tokens=withc.tokens)
        else:
            logits = m(ctx, valid, anchor)
    p = torch.softmax(logits.float(), -1)
    assert torch.allclose(withc.confidence, p.gather(-1, withc.tokens[..., None]).squeeze(-1), atol=1e-5)


def test_report_plots_tell_series_apart_and_hide_checkpoint_paths():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("report", Path(__file__).resolve().parents[2] / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    names = ["hybrid", "suffix", "dlite", "ngram"] + [f"x{i}" for i in range(10)]
    styles = [tuple(sorted(report.series_style(n, i).items())) for i, n in enumerate(names)]
    assert len(set(styles)) == len(styles)  # 14 series, no two drawn alike
    assert len({s["color"] for s in (report.series_style(n, i) for i, n in enumerate(names[:12]))}) == 12
    assert report.display_name("dlite:artifacts/train/run_v2/stabilize/model") == "dlite (run_v2)"
    assert report.display_name("ngram") == "ngram"


def test_skip_dlite_scores_the_lookup_over_dlites_length():
    """The skip-DLite threshold was tuned on chains of DLite's K: with chains longer than K the
    lookup is scored over its first K tokens, so a long tail alone does not skip DLite."""
    quote = list(range(100, 160))
    toks = [1, 2] + quote + [3, 4] + quote[:20]
    idx = SuffixIndex(toks)
    ps = lookup_only(idx, 15, Calibration())[1]
    s7, s15 = expected_accepted(ps[:7]), expected_accepted(ps)
    assert s15 > s7
    cal = Calibration(skip_dlite_at=(s7 + s15) / 2)
    for horizon, want in ((7, True), (None, False)):
        bl = BatchLookup(15, calibration=cal, dlite_drafts=horizon)
        req = _Req("q", toks[:-1])
        bl.on_extend([req])
        _, _, need = bl.begin_round([req], [toks[-1]])
        assert need is want, (horizon, s7, s15)
    # the reference engine's hybrid drafter follows the same rule (chooser.needs_dlite): chains of
    # 15 past DLite's K = 7 run DLite here; with K = 15 the lookup's whole chain skips it
    from dlite_lab.reference.drafters import DraftRequest

    for k, want in ((7, True), (15, False)):
        calls = []
        dl = _StubDLite(k, calls)
        dr = HybridEngineDrafter(dl, calibration=cal, num_drafts=15)
        dr.draft(DraftRequest(tokens=list(toks), hidden=torch.zeros(1, 1, 1), hidden_start=len(toks) - 1))
        assert bool(calls) is want, (k, s7, s15)


class _StubDLite:
    """A DLite engine adapter that drafts K zeros and records that it ran."""

    capture_layer_ids, hidden_rows_needed = [0], 1

    def __init__(self, k, calls):
        self.num_drafts, self.calls, self.model = k, calls, self

    def context_inputs(self, req):
        return None, None, None, None

    def propose(self, *args, **kw):
        self.calls.append(1)
        return types.SimpleNamespace(tokens=torch.zeros(1, self.num_drafts, dtype=torch.int64),
                                     confidence=torch.full((1, self.num_drafts), 0.5))
