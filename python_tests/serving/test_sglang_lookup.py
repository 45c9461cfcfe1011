"""sglang's DLITE worker with hybrid drafting (the default): the suffix lookup beside DLite.

On the real default target (SmolLM2-135M-Instruct, float32) with the shipped drafter: DLITE's
output equals no speculation token for token, the lookup drafts rounds and is accepted, and the
per-request lookup state follows the running batch: a request that finished or was aborted has
no index left once the next decode round runs. (the setting lookup: false giving today's DLite
rounds is tested in test_sglang_lossless.py: rounds == the reference engine's DLite rounds.)
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import sglang_fixtures as F

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''

MESSAGES = [
    "Here is a function:\n```python\n" + CODE + "```\nRename `merged` to `result` and show the whole function.",
    "Write a Python function that checks whether a string is a palindrome.",
]


def _sp(n, **kw):
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **kw}


def _events(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_hybrid_equals_nospec_and_frees_lookup_state(tmp_path, monkeypatch):
    from sglang_dlite.model.dlite import shipped_drafter_path

    drafter = shipped_drafter_path()
    if drafter is None:
        pytest.skip("no shipped drafter checkpoint in this build")
    target, prompts = F.default_target_chat_prompts(MESSAGES)
    with F.engine(target, skip_tokenizer_init=True) as e:
        base = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=_sp(64))]
    trace = tmp_path / "lookup_trace.jsonl"
    # chains: this test reads the chain hybrid's sources and widths (tree rounds: test_sglang_tree.py)
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"tree_max_batch_size": 0, "lookup_trace": str(trace)}))
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=_sp(64))
        assert [o["output_ids"] for o in outs] == base
        ev = [x for x in _events(trace) if x["event"] == "decode"]
        sources = [s for x in ev for s in x["sources"]]
        acc_lookup = sum(a for x in ev for s, a in zip(x["sources"], x["accepted"]) if s in ("suffix", "mixed"))
        assert acc_lookup > 0, sources  # the lookup drafted rounds and was accepted
        assert "dlite" in sources  # and DLite drafted the others
        # the CPU default picks the verify width per round: several widths ran, output unchanged
        # (width 1: a round the draft gate ran without drafts, to measure plain decoding's cost)
        widths = {x["width"] for x in ev}
        assert len(widths - {1}) > 1 and widths <= set(range(1, 17)), widths
        # the CPU default lets the lookup continue a chain past DLite's K = 7 drafts (W up to 16):
        # rounds wider than DLite alone could fill (W > K + 1) ran, output unchanged. (How many
        # of their drafts are accepted depends on which widths the policy, timing rounds online,
        # keeps picking: under CPU contention it ran them once and moved on; a benchmark's question.)
        assert max(widths) > 8, widths
        verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
        assert verify < sum(len(b) for b in base) / 1.5, verify

        # Finish and abort: a long request (aborted mid-generation) and a short one (finishes);
        # then a third request: while it decodes, the lookup holds its index only.
        async def scenario():
            long_ = asyncio.ensure_future(e.async_generate(
                input_ids=prompts[1], sampling_params=_sp(400), rid="lk-abort"))
            short = asyncio.ensure_future(e.async_generate(
                input_ids=prompts[0], sampling_params=_sp(24), rid="lk-finish"))
            t0 = time.time()
            while time.time() - t0 < 120:
                if any("lk-abort" in x.get("rids", []) for x in _events(trace) if x["event"] == "decode"):
                    break
                await asyncio.sleep(0.2)
            e.tokenizer_manager.abort_request(rid="lk-abort")
            r_long, r_short = await asyncio.gather(long_, short)
            r_third = await e.async_generate(input_ids=prompts[1], sampling_params=_sp(16), rid="lk-third")
            return r_long, r_short, r_third

        r_long, r_short, r_third = e.loop.run_until_complete(scenario())
    assert r_long["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(r_short["output_ids"]) == 24 and len(r_third["output_ids"]) == 16
    ev = _events(trace)
    assert any("lk-abort" in x["live"] for x in ev)  # it was indexed
    third = [x for x in ev if x["event"] == "decode" and "lk-third" in x["rids"]]
    assert third and all(x["live"] == ["lk-third"] for x in third), third[:3]


def test_serving_options_resolve_every_switch_once():
    """Every DLITE setting comes from the one JSON: one object, the documented defaults, the same
    names; the variables of earlier releases (SGLANG_DLITE_LOOKUP, ...) are read no more."""
    from sglang_dlite.settings import ServingOptions

    assert ServingOptions.from_env({}) == ServingOptions()
    assert ServingOptions.from_env({"SGLANG_DLITE_LOOKUP": "0", "SGLANG_DLITE_VERIFY_WIDTH": "fixed",
                                    "SGLANG_DLITE_TP_CHECK": "1"}) == ServingOptions()
    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": json.dumps({
        "lookup": False, "lookup_trace": "/tmp/t.jsonl", "verify_width": "fixed", "drafter_dtype": " BFloat16 ",
        "draft_cuda_graph": False, "tp_sync": False, "tp_check": True, "round_log": "/tmp/r.jsonl"})})
    assert o == ServingOptions(lookup=False, lookup_trace="/tmp/t.jsonl", verify_width="fixed",
                               drafter_dtype="bfloat16", draft_cuda_graph=False, tp_sync=False, tp_check=True,
                               round_log="/tmp/r.jsonl")
    assert not o.adaptive_width("cpu", False, 1)
    assert ServingOptions().adaptive_width("cpu", False, 1) and not ServingOptions().adaptive_width("cuda:0", False, 1)
    with pytest.raises(AttributeError):  # frozen: read once at launch, never changed
        o.lookup = True
