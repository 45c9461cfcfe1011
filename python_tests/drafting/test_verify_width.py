"""The per-round verify width (sglang_dlite/drafting/budget.py): expected tokens, the cost
model it learns, the choice it makes from both, and when the worker turns it on."""

import pytest

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.drafting.budget import VerifyWidthPolicy, adaptive_width_wanted, expected_committed


def test_expected_committed_is_one_plus_sum_of_reach():
    ps = [0.5, 0.4, 0.9]
    assert expected_committed(ps, 0) == 1.0
    assert expected_committed(ps, 1) == pytest.approx(1.5)
    assert expected_committed(ps, 3) == pytest.approx(1 + 0.5 + 0.2 + 0.18)
    assert expected_committed(ps, 7) == expected_committed(ps, 3)  # a chain gains nothing past its end


def _brute_best(policy, chains, lo, hi):
    vals = {w: sum(expected_committed(p, w - 1) for p in chains) / policy.cost(len(chains) * w) for w in range(lo, hi + 1)}
    best = max(vals.values())
    return min(w for w, v in vals.items() if v >= best - 1e-12)


def _measured(policy, costs):
    for rows, c in costs.items():
        for _ in range(3):
            policy.observe(rows, c)


def test_flat_cost_takes_the_whole_chain():
    pol = VerifyWidthPolicy(8)
    _measured(pol, {w: 1.0 for w in range(2, 9)})
    assert pol.choose([[0.3] * 7]) == 8
    assert pol.choose([[0.9, 0.8]]) == 3  # a 2-draft chain: nothing past it is worth a row
    assert pol.choose([[]]) == 2  # no draft at all: the narrowest verify


def test_a_cost_step_cuts_an_unlikely_tail():
    # the CPU shape: 1-6 rows cost the same, 7+ rows 30 % more
    pol = VerifyWidthPolicy(8)
    _measured(pol, {w: (1.0 if w <= 6 else 1.3) for w in range(2, 9)})
    tail = [0.9, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1]
    w = pol.choose([tail])
    assert w <= 6 and w == _brute_best(pol, [tail], 2, 8)
    sure = [0.99] * 7
    assert pol.choose([sure]) == _brute_best(pol, [sure], 2, 8) == 8
    # a batch of 2: rows = 2 w, so the step at 7 rows is already at w = 4
    pol2 = VerifyWidthPolicy(8)
    _measured(pol2, {r: (1.0 if r <= 6 else 1.3) for r in range(4, 17, 2)})
    chains = [[0.5] * 7, [0.2] * 7]
    assert pol2.choose(chains) == _brute_best(pol2, chains, 2, 8) == 3


def test_width_and_chain_are_chosen_together():
    """A long lookup chain whose value lies in its tail (first token unlikely, then a sure quote)
    beats DLite at full length but not when the verify is cut: the hybrid re-picks each request's
    chain for every width (BatchLookup.expected_table), so a cut round verifies DLite's chain,
    and the width is chosen on those per-width values."""
    from sglang_dlite.drafting.hybrid import BatchLookup
    from sglang_dlite.drafting.chooser import Calibration, Candidate

    bl = BatchLookup(15, calibration=Calibration(margin=0.0))
    lookup = Candidate(0, list(range(100, 115)), [0.3] + [0.99] * 14)
    dlite = Candidate(7, list(range(7)), [0.8, 0.6, 0.3, 0.2, 0.1, 0.1, 0.1], alone=True)
    table = bl.expected_table([[lookup, dlite]], 15)
    assert table[0][1] == pytest.approx(0.8)  # one draft: DLite's
    assert table[0][15] == pytest.approx(lookup.score())  # all 15: the lookup's
    # the CPU shape: <= 6 rows flat, then 30 % more, then 60 % more from 12 rows
    pol = VerifyWidthPolicy(16)
    _measured(pol, {w: (1.0 if w <= 6 else 1.3 if w < 12 else 1.6) for w in range(2, 17)})
    w = pol.choose_expected(table)
    vals = {x: (1 + table[0][x - 1]) / pol.cost(x) for x in range(2, 17)}
    assert vals[w] == pytest.approx(max(vals.values()))
    # choosing from the full-length chain's probabilities instead would verify the lookup's chain
    # at a width where DLite's is worth more
    class _Idx:  # pick_round pads an empty chain with the anchor
        tokens = [1]
    drafts, sources, _ = bl.pick_round([_Idx()], [[lookup, dlite]], 2)
    assert sources == ["dlite"] and drafts == [[0, 1]]
    drafts, sources, _ = bl.pick_round([_Idx()], [[lookup, dlite]], 15)
    assert sources == ["suffix"] and drafts == [list(range(100, 115))]


def test_unmeasured_widths_are_tried_then_judged():
    pol = VerifyWidthPolicy(8)
    chains = [[0.6] * 7]
    assert pol.cost(8) is None
    assert pol.choose(chains) == 8  # nothing measured: the fixed-width behaviour
    pol.observe(8, 0.10)
    # below the only measurement the estimate is proportional: a narrow round looks cheap, gets tried
    assert pol.cost(2) == pytest.approx(0.025)
    w = pol.choose(chains)
    assert w < 8
    pol.observe(w, 0.095)  # ... and turns out to cost nearly as much: the wide round wins again
    assert pol.choose(chains) == 8
    # between measurements: linear; above the largest: flat
    assert pol.cost((w + 8) / 2) == pytest.approx((0.095 + 0.10) / 2)
    assert pol.cost(20) == pytest.approx(0.10)
    assert pol.chosen[8] == 2


def test_a_width_measured_in_a_slow_spell_is_tried_again():
    """Costs inflated by a transient slowdown: the narrow width, chosen again and again, is
    re-measured at its true cost; the wide one is never chosen, so its inflated samples would stand
    for good. After ``stale_after`` rounds they are forgotten, the wide round gets its optimistic
    estimate, is tried, and wins again at its true cost."""
    pol = VerifyWidthPolicy(8, stale_after=64)
    chains = [[0.9] * 7]
    true = {2: 0.050, 8: 0.060}  # 8 rows cost little more than 2: the whole chain pays
    for w in (8, 2):
        for _ in range(3):
            pol.observe(w, true[w] * 5)  # a slow spell: everything costs 5x
    for _ in range(8):
        pol.observe(2, true[2])  # the spell is over: width 2 re-measured
    seen = []
    for _ in range(200):
        w = pol.choose(chains)
        seen.append(w)
        pol.observe(w, true.get(w, true[2] + (w - 2) * (true[8] - true[2]) / 6))
    assert seen[0] < 8  # stuck narrow while the wide width's slow samples stand
    assert seen[-1] == 8 and seen.index(8) <= 64 + VerifyWidthPolicy.STALE_CHECK + 1
    assert pol.cost(8) == pytest.approx(0.060)
    never = VerifyWidthPolicy(8, stale_after=10**9)  # without forgetting: narrow for good
    for w in (8, 2):
        for _ in range(3):
            never.observe(w, true[w] * 5)
    for _ in range(8):
        never.observe(2, true[2])
    assert all(never.choose(chains) < 8 for _ in range(200))


def test_cost_is_robust_to_one_slow_round():
    pol = VerifyWidthPolicy(4)
    for s in (0.05, 0.05, 0.05, 0.05, 0.9):
        pol.observe(4, s)
    assert pol.cost(4) == pytest.approx(0.05)  # median of the recent rounds, not the mean


def test_bad_widths_raise():
    with pytest.raises(ValueError, match="min_verify_width"):
        VerifyWidthPolicy(1)
    with pytest.raises(ValueError, match="min_verify_width"):
        VerifyWidthPolicy(4, min_verify_width=5)


def test_when_the_worker_adapts_the_width():
    assert adaptive_width_wanted("cpu", False)
    assert not adaptive_width_wanted("cuda:0", False)  # auto: CPU only
    assert not adaptive_width_wanted("cpu", False, tp_size=2)
    assert not adaptive_width_wanted("cpu", False, mode="fixed")
    assert adaptive_width_wanted("cuda:0", True, mode="adaptive")
    assert not adaptive_width_wanted("cuda:0", False, mode="adaptive")
    with pytest.raises(DLiteConfigError, match="auto, adaptive or fixed"):
        adaptive_width_wanted("cpu", False, mode="sometimes")


def _gate_run(gate, rounds, bs, draft_s, plain_s, committed):
    """Drive a DraftGate: each round it decides, then sees what that kind of round cost and gave."""
    chosen = []
    for _ in range(rounds):
        d = gate.should_draft(bs)
        chosen.append(d)
        gate.observe(bs, d, draft_s if d else plain_s, committed if d else 1.0)
    return chosen


def test_draft_gate_turns_drafting_off_when_drafts_are_never_accepted():
    """A drafter that is always wrong commits 1 token per round, like plain decoding, but pays its
    draft and a wider verify: after its warm-up and one plain round the gate runs plain rounds,
    probing drafting again only every probe_every rounds."""
    from sglang_dlite.drafting.budget import DraftGate

    gate = DraftGate(warmup=4, probe_every=32)
    chosen = _gate_run(gate, 200, bs=4, draft_s=0.017, plain_s=0.010, committed=1.0)
    assert chosen[:4] == [True] * 4 and chosen[4] is False  # warm-up, then one plain round
    assert sum(chosen) <= 4 + 200 // 32 + 1 and gate.off_rounds == 200 - sum(chosen)


def test_draft_gate_keeps_drafting_when_it_pays_and_follows_a_change():
    from sglang_dlite.drafting.budget import DraftGate

    gate = DraftGate(warmup=4, probe_every=32)
    chosen = _gate_run(gate, 300, bs=8, draft_s=0.017, plain_s=0.010, committed=2.5)  # 147 vs 100 tok/s
    assert sum(chosen) >= 300 - 1 - 300 // 32  # only the probes of plain decoding ran without drafts
    # the load grows: at 64 requests the same drafts no longer pay (wider verify, same acceptance)
    chosen = _gate_run(gate, 200, bs=64, draft_s=0.120, plain_s=0.040, committed=2.5)
    assert sum(chosen[-100:]) <= 100 // 32 + 1
    # batch size 8 is judged on its own measurements still
    assert _gate_run(gate, 1, bs=8, draft_s=0.017, plain_s=0.010, committed=2.5) == [True]


def test_draft_gate_pools_batch_sizes_in_power_of_two_buckets():
    """A serving batch changes size every few rounds: 5..8 requests are one bucket, so the gate
    warms up and decides there even though no single size repeats 16 times."""
    from sglang_dlite.drafting.budget import DraftGate, batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 33, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 64, 128]
    gate = DraftGate(warmup=16, probe_every=32)
    chosen = []
    for i in range(200):
        bs = 5 + i % 4  # 5, 6, 7, 8, 5, ...
        d = gate.should_draft(bs)
        chosen.append(d)
        gate.observe(bs, d, 0.017 if d else 0.010, 1.0)  # never accepted: plain rounds are faster
    assert chosen[:16] == [True] * 16 and sum(chosen[16:]) <= 200 // 32 + 1


def test_the_drafts_cost_inside_the_width_choice():
    """A round's throughput is its tokens over its whole period: with a costly draft (the rest of
    the round outside the verify, told by the draft gate) the 30 % dearer 7th-8th rows are worth
    verifying for a tail they were not worth verifying for alone."""
    from sglang_dlite.drafting.budget import DraftGate

    tail = [0.9, 0.9, 0.9, 0.7, 0.7, 0.7, 0.7]
    pol = VerifyWidthPolicy(8)
    _measured(pol, {w: (1.0 if w <= 6 else 1.3) for w in range(2, 9)})
    assert pol.rest(1) == 0.0 and pol.choose([tail]) == 6  # verify cost alone: stop before the step
    gate = DraftGate(width_policy=pol)
    for _ in range(5):
        pol.observe(8, 1.3)  # the verify of a drafting round at batch size 1 ...
        gate.observe(1, True, 1.3 + 3.0, 2.0)  # ... whose whole period was 3 s longer: the draft
    assert abs(pol.rest(1) - 3.0) < 1e-9
    assert pol.choose([tail]) == 8
    gate.observe(1, False, 0.5, 1.0)  # a plain round tells the width policy nothing
    assert abs(pol.rest(1) - 3.0) < 1e-9
