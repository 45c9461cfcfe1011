"""Real sglang engines on the CPU: DLITE output == no speculation == the reference engine (greedy).

One engine per configuration, shared by the tests of this module (start-up ~25-40 s each on 2
cores). Targets: a tiny random-weight "sticky" Llama (runs of repeats and jumps, so a
copy-trained drafter is accepted for 0..K tokens: every accept length occurs), a tiny random
Qwen3 (the Qwen3 code path) and one run on the real default target (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import sglang_fixtures as F


PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [60, 61, 62, 63, 64],
    [70, 12, 71, 13, 72, 14, 73, 15, 74, 16, 75, 17, 76, 18, 77, 19, 78, 3, 4, 79, 80, 81, 82, 83, 84,
     85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 3, 4, 5, 6],
]
MAX_NEW = [16, 24, 32, 20, 28]  # requests finish at different times


def _sp(n):
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama(sticky_llama_and_copy_dlite):
    target, drafter = sticky_llama_and_copy_dlite
    ref = [F.reference_greedy(target, drafter, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW)]
    return target, drafter, ref


def _accept_histogram(metas, n=5):
    """Rounds per number of accepted drafts (0..n-1, or longer where the suffix lookup continued
    a chain past DLite's K drafts), summed over requests."""
    n = max([n] + [len(m["spec_correct_drafts_histogram"]) for m in metas])
    hist = [0] * n
    for m in metas:
        for i, c in enumerate(m["spec_correct_drafts_histogram"]):
            hist[i] += c
    return hist


def _run_batch(engine):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[_sp(n) for n in MAX_NEW])
    return [o["output_ids"] for o in outs], [o["meta_info"] for o in outs]


async def _staggered(engine):
    """Requests join 0..4 x 0.3 s apart (while others decode) and finish at different times."""

    async def one(i):
        await asyncio.sleep(0.3 * i)
        o = await engine.async_generate(input_ids=PROMPTS[i], sampling_params=_sp(MAX_NEW[i]))
        return o["output_ids"]

    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def _multi_turn(engine, ref_fn):
    """Turn 2 = turn 1 prompt + its output + a new user message: hits the radix cache."""
    p1 = PROMPTS[2]
    o1 = engine.generate(input_ids=p1, sampling_params=_sp(12))
    p2 = p1 + o1["output_ids"] + [7, 8, 9, 10, 11, 12]
    o2 = engine.generate(input_ids=p2, sampling_params=_sp(16))
    p3 = p2 + o2["output_ids"] + [13]  # extend = last output + 1 token: shorter than C=3
    o3 = engine.generate(input_ids=p3, sampling_params=_sp(16))
    got = [o1["output_ids"], o2["output_ids"], o3["output_ids"]]
    want = [ref_fn(p1, 12), ref_fn(p2, 16), ref_fn(p3, 16)]
    cached = [o2["meta_info"].get("cached_tokens", 0), o3["meta_info"].get("cached_tokens", 0)]
    return got, want, cached


@pytest.fixture(scope="module")
def nospec_outputs(llama):
    target, _, _ = llama
    with F.engine(target, skip_tokenizer_init=True) as e:
        return _run_batch(e)[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_dlite_equals_nospec_equals_reference_llama(llama, nospec_outputs, overlap, monkeypatch):
    target, drafter, ref = llama
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"cpu_overlap": overlap}))  # a GPU's scheduler on a CPU
    assert nospec_outputs == ref, "sglang without speculation differs from the HF reference"
    with F.engine(target, dlite=drafter, overlap=overlap, skip_tokenizer_init=True) as e:
        assert e.get_server_info()["disable_overlap_schedule"] is (not overlap)
        got, metas = _run_batch(e)
        assert got == ref
        # every accept length 0..K occurs over the batch (the drafter is accepted partially)
        hist = _accept_histogram(metas)
        assert hist[0] > 0 and sum(hist[1:]) > 0, hist
        assert max(m["spec_accept_length"] for m in metas) > 1.5
        # concurrent requests joining while others decode
        assert e.loop.run_until_complete(_staggered(e)) == ref
        # multi-turn conversation through the prefix cache
        ref_fn = lambda p, n: F.reference_greedy(target, drafter, [p], n)[0]  # noqa: E731
        got_mt, want_mt, cached = _multi_turn(e, ref_fn)
        assert got_mt == want_mt
        assert all(c > 0 for c in cached), f"no prefix-cache hit on later turns: {cached}"


def test_padded_batch_attention_equals_the_reference(monkeypatch):
    """Requests of similar length attend as one padded batch (the CPU verify hook's ``attend_padded``):
    DLITE's verify forwards and, with the setting cpu_attention "same" (the benchmarks' like-for-like
    baseline), no speculation's decode forwards; float32 output equal to the reference's either way.
    With the switch every prefill attends through ``attend_prefill`` too: a follow-up request that
    continues a cached prompt + answer (a radix-cache hit, its new tokens over the cached prefix) is
    also the reference's. The default target (a tiny random one barely reads its context: swapping two
    requests' attention outputs left its greedy tokens unchanged)."""
    from sglang_dlite.model.dlite import shipped_drafter_path

    drafter = shipped_drafter_path()
    if drafter is None:
        pytest.skip("no shipped drafter checkpoint in this build")
    target, prompts = F.default_target_chat_prompts(["Write a Python function that reverses a list.",
                                                     "Write a Python function that sums a list.",
                                                     "Explain what a Python dictionary is used for."])
    ref = F.reference_greedy(target, drafter, prompts, 32)
    follow_up = prompts[0] + ref[0][:20]  # the first request's prompt and 20 of its tokens: cached
    ref_follow_up = F.reference_greedy(target, drafter, [follow_up], 16)[0]
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"cpu_attention": "same"}))
    for dlite in (None, drafter):
        with F.engine(target, dlite=dlite, skip_tokenizer_init=True) as e:
            outs = e.generate(input_ids=prompts, sampling_params=[_sp(32)] * len(prompts))
            assert [o["output_ids"] for o in outs] == ref, f"dlite={dlite}"
            out = e.generate(input_ids=follow_up, sampling_params=_sp(16))
            assert out["meta_info"]["cached_tokens"] >= len(prompts[0]), out["meta_info"]
            assert out["output_ids"] == ref_follow_up, f"dlite={dlite}"


def test_dlite_verifies_a_prefix_of_the_drafts(llama):
    """--speculative-num-draft-tokens 3 with a K=4 drafter: each round verifies the anchor + the
    first 2 drafts (cheaper verify where it is compute-bound); still exactly the reference."""
    target, drafter, ref = llama
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True, speculative_num_draft_tokens=3) as e:
        got, metas = _run_batch(e)
    assert got == ref
    hist = _accept_histogram(metas)
    assert hist[2] > 0 and not any(hist[3:]), hist  # 0..2 drafts accepted, never more


def test_dlite_qwen3_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_qwen3")
    target = F.save_tiny_qwen3(d / "target")
    drafter = F.train_copy_dlite(d / "drafter", target, steps=40)
    ref = [F.reference_greedy(target, drafter, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW)]
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
        got, _ = _run_batch(e)
    assert got == ref


@pytest.mark.parametrize("trees", [False, True], ids=["chain", "tree"])
def test_real_target_shipped_drafter_rounds_equal_reference(monkeypatch, trees):
    """The default target + the shipped drafter: sglang's DLITE worker and the reference engine
    produce the same tokens in the same number of verify rounds. The round count depends on every
    draft, so a worker that carried the wrong context rows (or none) to the drafter would differ
    here even though its output stays lossless. With the lookup turned off
    (the setting lookup: false) DLITE drafts with DLite alone: exactly the reference DLite rounds --
    chains (the setting tree_max_batch_size: 0), or token trees of W - 1 = K nodes branching along
    DLite's greedy chain (serving/rounds.py; the reference engine's TreeEngineDrafter(branching="chain")),
    whose rounds also depend on which path the tree verify accepted and which rows it carried."""
    from sglang_dlite.model.dlite import shipped_drafter_path

    # verify_width fixed: every round W wide (no draft gate), as the reference
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"lookup": False, "verify_width": "fixed",
                                                          "tree_max_batch_size": 4 if trees else 0}))

    drafter = shipped_drafter_path()
    if drafter is None:
        pytest.skip("no shipped drafter checkpoint in this build")
    target, prompts = F.default_target_chat_prompts(["Write a Python function that checks whether a string is a palindrome.",
                                                     "Explain the difference between a list and a tuple in Python."])
    K = json.loads((Path(drafter) / "config.json").read_text())["block_size"]
    ref = F.reference_results(target, drafter, prompts, 40, tree_nodes=K if trees else None)
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
        outs = e.generate(input_ids=prompts, sampling_params=_sp(40))
    assert [o["output_ids"] for o in outs] == [r.output_ids for r in ref]
    assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [len(r.rounds) for r in ref]
    assert sum(r.accepted for x in ref for r in x.rounds) > 0  # the drafter is accepted at all


def test_dlite_bf16_parts_from_nospec_only_at_precision_ties(llama):
    """bfloat16, what deployments run. A verify pass computes a token's logits in a W-token GEMM, a
    decode step in a 1-token GEMM; bf16 rounds the two differently, so greedy outputs may part at
    an exact or near tie. Every divergence from no speculation (bf16 too) must be such a tie of
    the float32 target (dlite_lab/divergence.py), and the drafter must still be accepted."""
    from dlite_lab.divergence import Fp32LogitGap, classify_divergences

    target, drafter, _ = llama
    with F.engine(target, skip_tokenizer_init=True, dtype="bfloat16") as e:
        base, _ = _run_batch(e)
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True, dtype="bfloat16") as e:
        got, metas = _run_batch(e)
    recs = classify_divergences(PROMPTS, got, base, Fp32LogitGap(target), tie_margin=0.1)
    print("bf16 divergences:", recs)
    assert all(r["tie"] for r in recs), recs
    assert len(recs) < len(PROMPTS), recs
    assert max(m["spec_accept_length"] for m in metas) > 1.5
