"""dlite_lab/divergence.py (bf16 precision ties vs real mismatches) and bench/e2e.py's
median-of-repeats aggregation."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from dlite_lab.divergence import (Fp32LogitGap, classify_divergences, first_divergence, is_mismatch,
                                     top2_gap_change)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 9]) == 2  # one stopped where the other went on
    assert first_divergence([], []) is None


def test_classify_divergences_ties_and_mismatches():
    gaps = {(7, 8): -0.01, (4, 5): -3.0, (6, 9): 2.0}  # logit(output token) - logit(baseline token)
    seen = []

    def score(prefix, a, b):
        seen.append((list(prefix), a, b))
        return gaps[(a, b)]

    prompts = [[1], [2], [3], [4], [5]]
    outs = [[10, 7, 1], [20, 4], [30], [40, 41], [6]]
    base = [[10, 8, 1], [20, 5], [30], [40], [9]]
    recs = classify_divergences(prompts, outs, base, score, tie_margin=0.25)
    assert [r["request"] for r in recs] == [0, 1, 3, 4]
    assert recs[0]["tie"] and recs[0]["position"] == 1 and recs[0]["fp32_logit_gap"] == 0.01
    assert not recs[1]["tie"] and recs[1]["token"] == 4 and recs[1]["baseline_token"] == 5
    assert not recs[2]["tie"] and recs[2]["baseline_token"] is None and recs[2]["fp32_logit_gap"] is None
    # beyond the margin, but the float32 target prefers the output's token: the baseline is off
    assert recs[3]["baseline_off"] and not recs[3]["tie"] and recs[3]["fp32_logit_gap"] == 2.0
    assert [is_mismatch(r) for r in recs] == [False, True, True, False]
    # scored after the prompt + the common prefix of the outputs
    assert seen == [([1, 10], 7, 8), ([2, 20], 4, 5), ([5], 6, 9)]
    with pytest.raises(ValueError, match="2 prompts, 1 outputs"):
        classify_divergences([[1], [2]], [[1]], [[1]], score, 0.25)


def test_measured_bf16_noise_widens_the_margin_per_sequence():
    """A flip at a float32 gap of 0.288 is a mismatch under the fixed 0.25 margin, a precision tie
    where the bf16 error measured on that sequence reaches 0.5, and still a mismatch where it is 0.1
    (the demo's bf16 check on a CPU with AMX: a flip at 0.288 on a sequence whose bf16 error went to 0.5)."""
    asked = []

    def noise(prefix):
        asked.append(list(prefix))
        return {1: 0.5, 2: 0.1}[prefix[0]]

    prompts, outs, base = [[1], [2]], [[5, 7], [5, 7]], [[5, 8], [5, 8]]
    score = lambda prefix, a, b: -0.288  # noqa: E731 (the baseline's token preferred by 0.288)
    plain = classify_divergences(prompts, outs, base, score, tie_margin=0.25)
    assert [r["tie"] for r in plain] == [False, False] and all(is_mismatch(r) for r in plain)
    assert all("bf16_noise" not in r for r in plain)
    measured = classify_divergences(prompts, outs, base, score, tie_margin=0.25, noise=noise)
    assert [r["tie"] for r in measured] == [True, False]
    assert [r["bf16_noise"] for r in measured] == [0.5, 0.1]
    assert [is_mismatch(r) for r in measured] == [False, True]
    assert asked == [[1, 5], [2, 5]]  # the sequence up to the divergence


def test_top2_gap_change():
    l32 = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.5]])
    l16 = torch.tensor([[2.5, 1.25, 0.0], [0.0, 2.0, 2.0]])
    # position 0: top-2 (0, 1), gap 2.0 -> 1.25; position 1: top-2 (1, 2), gap 0.5 -> 0.0
    assert top2_gap_change(l32, l16).tolist() == [0.75, 0.5]


def test_fp32_logit_gap_is_the_targets_logit_difference(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path / "t")
    prefix = [3, 4, 5, 6]
    with torch.no_grad():
        lg = m(torch.tensor([prefix])).logits[0, -1]
    gap = Fp32LogitGap(str(tmp_path / "t"))
    assert gap(prefix, 7, 9) == pytest.approx(float(lg[7] - lg[9]), abs=1e-5)  # signed
    assert gap(prefix, 9, 7) == pytest.approx(float(lg[9] - lg[7]), abs=1e-5)
    assert gap(prefix, 9, 9) == 0.0
    # the bf16 error of the top-2 gap, over every position of the prefix, from the same child process
    with torch.no_grad():
        want = float(top2_gap_change(m(torch.tensor([prefix])).logits[0],
                                     m.to(torch.bfloat16)(torch.tensor([prefix])).logits[0]).max())
    assert want > 0
    assert gap.bf16_noise(prefix) == pytest.approx(want, abs=1e-5)
    gap.close()


def test_e2e_aggregate_takes_the_median_of_repeats():
    from dlite_lab.benchmarking import sglang_runs as e2e

    def row(c, tps, tau):
        return {"mode": "dlite", "concurrency": c, "tokens_per_s": tps, "wall_s": 100 / tps,
                "mean_latency_s": 1.0 / tps, "tau": tau}

    runs = [[row(1, 10.0, 1.5), row(4, 20.0, 1.4)], [row(1, 14.0, 1.5), row(4, 18.0, 1.6)],
            [row(1, 11.0, 1.5), row(4, 30.0, 1.5)]]
    out = e2e.aggregate(runs)
    assert [r["tokens_per_s"] for r in out] == [11.0, 20.0]
    assert [r["tau"] for r in out] == [1.5, 1.5]
    assert (out[0]["tokens_per_s_min"], out[0]["tokens_per_s_max"], out[0]["repeats"]) == (10.0, 14.0, 3)
    # an even number of repeats: the mean of the middle two
    assert e2e.aggregate(runs[:2])[0]["tokens_per_s"] == 12.0


def test_e2e_round_stats_reads_the_round_log_after_an_offset(tmp_path):
    """bench/e2e.py's per-level draft / verify split: only the rounds logged after the level began
    (the file offset), a torn last line skipped; no log (no speculation) gives {}."""
    from dlite_lab.benchmarking import sglang_runs as e2e
    log = tmp_path / "rounds.jsonl"
    log.write_text('{"bs": 1, "draft_ms": 50.0, "verify_ms": 500.0}\n')
    mark = log.stat().st_size
    with open(log, "a") as f:
        f.write('{"bs": 4, "draft_ms": 10.0, "verify_ms": 100.0}\n{"bs": 4, "draft_ms": 20.0, "verify_ms": 300.0}\n{"bs": 4, "dr')
    assert e2e.round_stats(str(log), mark) == {"decode_rounds": 2, "draft_ms_per_round": 15.0, "verify_ms_per_round": 200.0,
                                                "tree_round_share": 0.0}
    assert e2e.round_stats(str(tmp_path / "none.jsonl"), 0) == {}


def _bench(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_e2e_tau_by_output_position_from_the_round_log(tmp_path):
    """The round log's per-request output position and accepted drafts give tau per 32-token bucket
    of the answer: committed tokens (accepted + 1) over request-rounds, pooled over levels."""
    from dlite_lab.benchmarking import sglang_runs as e2e
    log = tmp_path / "rounds.jsonl"
    log.write_text('{"bs": 2, "draft_ms": 1, "verify_ms": 2, "pos": [1, 40], "acc": [3, 0]}\n'
                   '{"bs": 2, "draft_ms": 1, "verify_ms": 2, "pos": [5, 41], "acc": [1, 2]}\n'
                   '{"bs": 1, "draft_ms": 1, "verify_ms": 2}\n')  # a round logged without positions
    stats = e2e.round_stats(str(log), 0)
    assert stats["rounds_by_position"] == {"0": [2, 6], "32": [2, 4]}
    assert e2e.tau_by_position([stats]) == {0: 3.0, 32: 2.0}
    assert e2e.tau_by_position([stats, {"rounds_by_position": {"32": [2, 8]}}]) == {0: 3.0, 32: 3.0}
    assert e2e.tau_by_position([{}]) == {}


def test_e2e_mode_settings_parse_and_refuse_a_bad_pair():
    from dlite_lab.benchmarking import sglang_runs as e2e
    assert e2e.parse_settings("dlite:8+tree_max_batch_size=64+online=true+drafter_dtype=bfloat16") == (
        "dlite:8", {"tree_max_batch_size": 64, "online": True, "drafter_dtype": "bfloat16"})
    assert e2e.parse_settings("nospec") == ("nospec", {})
    assert e2e.parse_settings("dlite+online=lr=1e-3;update_every=16") == ("dlite", {"online": "lr=1e-3,update_every=16"})
    with pytest.raises(SystemExit, match="key=value"):
        e2e.parse_settings("dlite+tree_max_batch_size")


def test_load_matrix_resumes_and_reports_medians_over_repeats(tmp_path, monkeypatch):
    """bench/load_matrix.py: a level already in runs.jsonl is not run again; the report takes the
    median over repeats per (cell, mode, level) and the speed-up over no speculation's median there;
    level c runs max(min_requests, 2c) requests; runs of the other --baseline-attention (a record without
    one: sglang's), and "same" runs from before the prefill attention was the project's (a record without
    prefill_attention), are neither done nor reported."""
    lm = _bench("load_matrix")
    args = lm.parse_args(["--concurrency", "1,4", "--modes", "nospec,dlite", "--repeats", "3", "--out-dir",
                          str(tmp_path), "--no-score", "--min-requests", "4", "--requests", "6"])
    assert [lm.requests_at(args, 6)(c) for c in (1, 2, 3, 4)] == [4, 4, 6, 6]

    def rec(mode, rep, c, tps, tau=None, attention="same", prefill="same"):
        return {"workload": "agent-stdlib", "max_new_tokens": 128, "dtype": "bfloat16", "mode": mode, "repeat": rep,
                "concurrency": c, "outputs": [[1, 2]], **({"attention": attention} if attention else {}),
                **({"prefill_attention": prefill} if prefill else {}),
                "row": {"mode": mode, "concurrency": c, "requests": 1, "tokens_per_s": tps, "ttft_p50_s": 1.0,
                        "itl_p50_ms": 10.0, "itl_p99_ms": 20.0, "tau": tau,
                        **({"rounds_by_position": {"0": [2, 5]}} if tau else {})}}

    recs = [rec("nospec", r, c, 10.0 + r) for r in range(3) for c in (1, 4)]
    recs += [rec("dlite", r, c, 20.0 + 4 * r, 2.5) for r in range(3) for c in (1,)]  # dlite at 4 never ran
    recs += [rec("dlite", r, 4, 99.0, 2.5, attention=a, prefill=None) for r in range(3)
             for a in ("sglang", None, "same")]  # ... like for like
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ran = []
    monkeypatch.setattr(lm, "build_requests", lambda *a: [[0]] * 6)
    monkeypatch.setattr(lm, "run_sglang", lambda mode, *a, **kw: ran.append((mode, tuple(a[3]))))
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    lm.measure(args, tmp_path)
    assert sorted(ran) == [("dlite", (4,))] * 3  # each repeat runs only its missing level
    out = lm.report(args, tmp_path)
    by = {(r["mode"], r["concurrency"]): r for r in out["rows"]}
    assert by[("nospec", 1)]["tokens_per_s"] == 11.0 and by[("dlite", 1)]["tokens_per_s"] == 24.0
    assert by[("dlite", 1)]["speedup"] == round(24.0 / 11.0, 3) and by[("nospec", 1)]["speedup"] is None
    assert by[("dlite", 1)]["tau_by_position"] == {0: 2.5} and ("dlite", 4) not in by
    assert out["baseline_attention"] == "same"
    assert (tmp_path / "speedup_vs_concurrency.png").exists() and (tmp_path / "tau_by_position.png").exists()
