"""DLITE under sglang tensor parallelism (--tp-size 2) and data parallelism (--dp-size 2), on the CPU.

One engine per configuration (a TP/DP engine starts in ~40-90 s on this 2-core machine), on the
tiny random "sticky" Llama of test_sglang_lossless.py: vocabulary 96, so under TP 2 each rank holds
64 padded rows of the embedding and of the (untied) LM head -- the worker's gather must strip the
padding. The oracle is the HF reference engine (DLite alone, the setting lookup: false), whose outputs
and rounds equal a tp-1 DLITE engine's and no speculation's (test_sglang_lossless.py):
  * tp 2 / dp 2 greedy output == the reference (== no speculation at tp 1),
  * the same number of verify rounds and the same accepted-drafts histogram as tp 1,
  * with the debug setting tp_check every round's drafts, accept lengths and bonus tokens are
    all-gathered and compared across the TP ranks before rank 0's are broadcast: a difference
    (greedy or sampled, seeded or not) raises in the scheduler and fails the test.
The real default target under --tp-size 2 / --dp-size 2 is run by bench/e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import sglang_fixtures as F

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [70, 12, 71, 13, 72, 14, 73, 15, 74, 16, 75, 17, 76, 18, 77, 19, 78, 3, 4, 79, 80, 81, 82, 83],
]
MAX_NEW = [16, 28, 32, 24]


def _sp(n, **kw):
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def llama(sticky_llama_and_copy_dlite):
    target, drafter = sticky_llama_and_copy_dlite
    ref = [F.reference_results(target, drafter, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW)]
    return target, drafter, ref


def _hist(counts, n):
    h = [0] * n
    for c in counts:
        h[c] += 1
    return h


def _check_against_reference(outs, ref, K):
    assert [o["output_ids"] for o in outs] == [r.output_ids for r in ref]
    # tp 1's rounds: the same number of verifies, the same accepted-drafts histogram per request.
    assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [len(r.rounds) for r in ref]
    for o, r in zip(outs, ref):
        got = list(o["meta_info"]["spec_correct_drafts_histogram"])  # sglang trims trailing zeros
        assert got + [0] * (K + 1 - len(got)) == _hist([x.accepted for x in r.rounds], K + 1)
    assert sum(x.accepted for r in ref for x in r.rounds) > 0  # drafts are accepted at all


def _parallel_env(monkeypatch):
    # sglang's CPU path needs each rank's cores (one NUMA node here) and an explicit KV size
    # (engine_kwargs passes max_total_tokens).
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    # DLite alone; verify_width fixed: dp2 on a CPU, every round W wide, as the reference; tp_check:
    # the ranks' drafts / accepts compared every round; chains, as the reference rounds (under tp the
    # worker never drafts trees; dp ranks would)
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"lookup": false, "verify_width": "fixed", "tp_check": true, '
                                              '"tree_max_batch_size": 0}')


@pytest.mark.parametrize("parallel", [{"tp_size": 2}, {"dp_size": 2}], ids=["tp2", "dp2"])
def test_parallel_equals_nospec_and_tp1_rounds(llama, monkeypatch, parallel):
    target, drafter, ref = llama
    _parallel_env(monkeypatch)
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True, **parallel) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=[_sp(n) for n in MAX_NEW])
        _check_against_reference(outs, ref, K=4)
        if "tp_size" not in parallel:
            return
        # Sampled rounds (sglang's sampler per verify row, top-p / top-k / plain; no per-request
        # seeds on this CPU stack, see test_sglang_verify.py): the ranks' accept lengths and bonus
        # tokens are compared every round (tp_check) -- a difference raises.
        sp = [_sp(24, temperature=0.9, top_p=0.9), _sp(24, temperature=1.0),
              _sp(24, temperature=0.7, top_k=5), _sp(24, temperature=1.0, min_p=0.1)]
        s1 = e.generate(input_ids=PROMPTS, sampling_params=sp)
        assert all(len(o["output_ids"]) == 24 for o in s1)
        assert all(o["meta_info"]["spec_verify_ct"] < 24 for o in s1)  # drafts accepted while sampling


@pytest.mark.parametrize("field,flag", [("attn_dp_size", "--attn-dp-size"), ("attn_cp_size", "--attn-cp-size"),
                                        ("enable_dp_attention", "--enable-dp-attention"),
                                        ("pp_size", "--pp-size")])
def test_unsupported_parallelism_refused_with_alternative(field, flag):
    from sglang_dlite.errors import DLiteConfigError
    from sglang_dlite.serving.algorithm import check_deployment

    args = SimpleNamespace(tp_size=2, dp_size=1, pp_size=1, disaggregation_mode="null", attn_dp_size=1,
                           attn_cp_size=1, enable_dp_attention=False)
    check_deployment(args)  # plain TP (and DP replicas) pass
    setattr(args, field, True if field == "enable_dp_attention" else 2)
    with pytest.raises(DLiteConfigError) as ei:
        check_deployment(args)
    msg = str(ei.value)
    assert flag in msg and ("--dp-size" in msg or "--pp-size 1" in msg)
