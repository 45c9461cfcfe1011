"""The agent benchmark's bookkeeping (``dlite_lab/benchmarking/agent_client.py``), no server: the
prefix-cache parity rule, the per-level summary and τ, and the /metrics reader. The real-client
runs against live servers are ``python_tests/serving/test_openai_tools.py``'s."""

from __future__ import annotations

import pytest

from dlite_lab.benchmarking.agent_client import TurnRecord, metric_total, parity, summarize


def rec(session, turn, cached, text="a", finish="length", out=8, verify=None, ttft=0.1, itl=(0.01,)):
    return TurnRecord(session=session, turn=turn, conv_id=str(session), prompt_tokens=100, cached_tokens=cached,
                      completion_tokens=out, ttft_s=ttft, latency_s=1.0, itl_s=list(itl), spec_verify_ct=verify,
                      finish_reason=finish, text=text)


def test_parity_counts_real_cache_misses_and_the_length_stop_seam_apart():
    base = [rec(0, 1, 0), rec(0, 2, 50), rec(0, 3, 90, finish="stop"), rec(0, 4, 120), rec(1, 1, 0), rec(1, 2, 40)]
    spec = [rec(0, 1, 0), rec(0, 2, 51),  # turn 1 stopped at max_tokens: +1 is the seam
            rec(0, 3, 90, finish="stop"), rec(0, 4, 121),  # turn 3 stopped on EOS: +1 is a real difference
            rec(1, 1, 0, text="b"), rec(1, 2, 7)]  # session 1 diverged at turn 1: its turn 2 is not compared
    p = parity(spec, base)
    assert p["cache_compared"] == 3
    assert p["cached_plus_one_at_length_stop"] == 1
    assert p["cached_tokens_mismatches"] == 1 and p["cached_examples"][0]["turn"] == 4
    assert p["output_mismatches"] == 1 and p["output_examples"] == [{"session": 1, "turn": 1}]
    assert parity(base, base)["cached_tokens_mismatches"] == 0


def test_summary_tau_is_rounds_weighted_and_excludes_the_prefill_token():
    turns = [rec(0, 1, 0, out=9, verify=2, ttft=0.4), rec(0, 2, 50, out=5, verify=4, ttft=0.2)]
    s = summarize(turns, wall_s=2.0)
    assert s["tau"] == pytest.approx((8 + 4) / 6)  # (completion - 1) per turn over all verify rounds
    assert turns[0].tau == pytest.approx(4.0)
    assert s["tokens_per_s"] == pytest.approx(7.0) and s["completion_tokens"] == 14
    assert s["ttft_turn2plus_p50_s"] == pytest.approx(0.2) and s["cached_tokens"] == 50
    assert summarize([rec(0, 1, 0)], 1.0)["tau"] is None  # no speculation: no τ


def test_metric_total_sums_label_sets_and_skips_other_names():
    text = ("# HELP x\nvllm:spec_decode_num_draft_tokens_total{model=\"a\"} 12.0\n"
            "vllm:spec_decode_num_draft_tokens_total{model=\"b\"} 3\n"
            "vllm:spec_decode_num_draft_tokens_created{model=\"a\"} 1.7e9\n")
    assert metric_total(text, "vllm:spec_decode_num_draft_tokens_total") == 15.0
    assert metric_total(text, "missing") == 0.0
