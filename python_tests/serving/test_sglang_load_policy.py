"""DLITE under load: the one settings JSON, the per-request opt-out and the batch-size off-switch.

The settings and the policy are checked as functions; the opt-out and the off-switch run in a real
sglang engine on the CPU (the tiny "sticky" Llama and its copy-trained drafter of
test_sglang_lossless): output identical to the reference, and the requests that must not draft
accept nothing.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

import sglang_fixtures as F
from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.drafting.budget import LoadPolicy, opted_out
from sglang_dlite.settings import ServingOptions

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
MAX_NEW = [24, 20, 28]


# ---------------------------------------------------------------------------------- settings
def test_settings_come_from_one_json_inline_or_a_file(tmp_path):
    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"max_batch_size": 48, "lookup": false}'})
    assert o.max_batch_size == 48 and o.lookup is False and o.verify_width == "auto"
    f = tmp_path / "dlite.json"
    f.write_text(json.dumps({"soft_batch_size": 16, "soft_num_drafts": 3, "drafter_dtype": " BFloat16 "}))
    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": str(f)})
    assert (o.soft_batch_size, o.soft_num_drafts, o.drafter_dtype) == (16, 3, "bfloat16")
    # what the worker logs once at start-up: every user setting, debug switches left out
    assert json.loads(o.describe()) == {
        "lookup": True, "verify_width": "auto", "drafter_dtype": "bfloat16", "draft_cuda_graph": True,
        "round_log": None, "max_batch_size": None, "soft_batch_size": 16, "soft_num_drafts": 3,
        "tree_max_batch_size": None, "tree_branches": 4}
    # the per-setting variables of earlier releases are read no more
    o = ServingOptions.from_env({"SGLANG_DLITE_CONFIG": '{"lookup": true}', "SGLANG_DLITE_LOOKUP": "0"})
    assert o.lookup is True


@pytest.mark.parametrize("text, msg", [
    ('{"max_batch": 4}', r"unknown setting\(s\) \['max_batch'\]; the settings are lookup, "),
    ('{"max_batch_size": -1}', "max_batch_size=-1: must be a batch size >= 0"),
    ('{"max_batch_size": "8"}', "max_batch_size='8'"),
    ('{"lookup": "no"}', "lookup='no': must be true or false"),
    ('{"verify_width": "wide"}', "verify_width='wide': use one of auto, adaptive, fixed"),
    ('{"drafter_dtype": "fp8"}', "drafter_dtype='fp8'"),
    ("[1, 2]", "must be a JSON object of settings, got list"),
    ('{"lookup": tru', "is not valid JSON"),
    ("/nonexistent/dlite.json", "cannot read it"),
])
def test_bad_settings_stop_the_launch_with_the_setting_named(text, msg):
    with pytest.raises(DLiteConfigError, match=msg):
        ServingOptions.from_env({"SGLANG_DLITE_CONFIG": text})


def test_load_policy_drafts_by_batch_size():
    pol = LoadPolicy(ServingOptions(max_batch_size=32, soft_batch_size=8, soft_num_drafts=2))
    assert [pol.num_drafts(bs, 15) for bs in (1, 8, 9, 32, 33)] == [15, 15, 2, 2, 0]
    assert LoadPolicy(ServingOptions()).num_drafts(10_000, 7) == 7  # no limits by default
    assert LoadPolicy(ServingOptions(max_batch_size=0)).num_drafts(1, 7) == 0


def test_opt_out_reads_custom_params():
    req = lambda cp: types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=cp))  # noqa: E731
    assert opted_out(req({"dlite_speculate": False}))
    assert not opted_out(req({"dlite_speculate": True})) and not opted_out(req(None)) and not opted_out(req({}))
    assert not opted_out(req({"dlite_speculate": 0}))  # only JSON false opts out
    rows = LoadPolicy.opted_out_rows([req(None), req({"dlite_speculate": False})], "cpu")
    assert rows.tolist() == [False, True] and LoadPolicy.opted_out_rows([req(None)], "cpu") is None


def test_a_zero_draft_round_runs_no_drafter():
    """n = 0: no drafter pass, no lookup (the index only takes the anchors), an empty [B, 0] block."""
    from sglang_dlite.drafting.hybrid import BatchLookup
    from sglang_dlite.serving.rounds import ChainRounds

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"the drafter ran ({name})")

    lookup = BatchLookup(7)
    reqs = [types.SimpleNamespace(rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=[4]) for i in range(2)]
    lookup.on_extend(reqs)
    w = types.SimpleNamespace(lookup=lookup, drafter=Boom(), graphs=Boom(), tp_same=lambda t, what: t)
    batch = types.SimpleNamespace(reqs=reqs, seq_lens_cpu=None, has_grammar=False)
    rd = ChainRounds(w).draft(batch, None, torch.tensor([5, 6]), 0)
    assert rd.tokens.tolist() == [[5], [6]] and not rd.drafted  # the anchors alone
    assert lookup.commit_round(reqs, [0, 0]) == ["off", "off"]
    assert lookup.states["r0"].tokens[-1] == 5 and lookup.states["r1"].tokens[-1] == 6


# ---------------------------------------------------------------------------------- sglang
@pytest.fixture(scope="module")
def llama(sticky_llama_and_copy_dlite):
    target, drafter = sticky_llama_and_copy_dlite
    ref = [F.reference_greedy(target, drafter, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW)]
    return target, drafter, ref


def _sp(n, **custom):
    sp = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
    return {**sp, "custom_params": custom} if custom else sp


def _accepted(meta) -> int:
    """Drafts accepted over the request's rounds (sglang's per-request histogram)."""
    return sum(i * c for i, c in enumerate(meta["spec_correct_drafts_histogram"]))


def test_an_opted_out_request_decodes_draft_free_beside_speculating_ones(llama, monkeypatch):
    target, drafter, ref = llama
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", '{"cpu_overlap": true}')  # the overlap scheduler a GPU runs
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True, overlap=True) as e:
        sps = [_sp(MAX_NEW[0]), _sp(MAX_NEW[1], dlite_speculate=False), _sp(MAX_NEW[2])]
        outs = e.generate(input_ids=PROMPTS, sampling_params=sps)
        alone = e.generate(input_ids=PROMPTS[1], sampling_params=_sp(MAX_NEW[1], dlite_speculate=False))
    assert [o["output_ids"] for o in outs] == ref
    metas = [o["meta_info"] for o in outs]
    assert _accepted(metas[1]) == 0  # every round of the opted-out request committed one token
    assert metas[1]["spec_verify_ct"] == metas[1]["completion_tokens"] - 1
    assert _accepted(metas[0]) + _accepted(metas[2]) > 0  # the others speculated in the same batch
    # alone (every request of the round opted out): no drafts at all, still the reference
    assert alone["output_ids"] == ref[1] and _accepted(alone["meta_info"]) == 0


def test_a_batch_over_the_hard_limit_verifies_the_anchors_alone(llama, monkeypatch, tmp_path):
    target, drafter, ref = llama
    log = tmp_path / "rounds.jsonl"
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"max_batch_size": 1, "round_log": str(log)}))
    with F.engine(target, dlite=drafter, skip_tokenizer_init=True) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=[_sp(n) for n in MAX_NEW])
        one = e.generate(input_ids=PROMPTS[2], sampling_params=_sp(MAX_NEW[2]))
    assert [o["output_ids"] for o in outs] == ref and one["output_ids"] == ref[2]
    rounds = [json.loads(x) for x in log.read_text().splitlines()]
    assert rounds and all(r["width"] == 1 for r in rounds if r["bs"] > 1)  # over the limit: anchors only
    assert any(r["width"] > 1 for r in rounds if r["bs"] == 1)  # at the limit: speculation
    assert _accepted(one["meta_info"]) > 0
