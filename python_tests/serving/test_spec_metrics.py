"""Issue 64 item 4, the parts that need no server: a request's speculation counters
(``spec_metrics.SpecCounts``) and their response object (vLLM's fields, then DLITE's), merging a
response's choices, who opts in, and the streamed response's last chunk (``spec_metrics_http``).
The HTTP side (non-streamed and streamed responses, ``/generate``, reconciling with ``/metrics``)
is tested on a real server in ``test_openai_tools.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_dlite.serving import spec_metrics as S
from sglang_dlite.serving import spec_metrics_http as H


def _counts(steps, k=4, detailed=False):
    c = S.SpecCounts(k, detailed=detailed)
    for accepted, drafts, source in steps:
        c.add(accepted, drafts, source, committed=accepted + 1)
    return c


def test_counts_give_vllms_fields_and_the_projects_tau():
    c = _counts([(4, 4, "dlite"), (0, 4, "suffix"), (2, 4, "dlite"), (0, 0, "dlite")], detailed=True)
    out = c.summary(completion_tokens=1 + 5 + 1 + 3 + 1)  # the prefill's token + each step's commits
    assert list(out)[:7] == list(S._VLLM_FIELDS)  # vLLM's shape first
    assert out["num_spec_steps"] == 4 and out["num_draft_tokens"] == 12 and out["num_accepted_draft_tokens"] == 6
    assert out["mean_acceptance_length"] == 1 + 6 / 4 and out["draft_acceptance_rate"] == 6 / 12
    assert out["acceptance_histogram"] == [2, 0, 1, 0, 1] and out["num_spec_tokens"] == 4
    assert out["accepted_per_position"] == [2, 2, 1, 1]
    assert out["tau"] == pytest.approx(10 / 4)  # drafting/tau.py: (n - 1) / steps
    assert out["num_drafting_steps"] == 3 and out["num_tree_steps"] == 0
    assert out["sources"] == {  # a step with no draft is "off", whoever would have drafted
        "dlite": {"num_spec_steps": 2, "num_accepted_draft_tokens": 6, "num_committed_tokens": 8},
        "suffix": {"num_spec_steps": 1, "num_accepted_draft_tokens": 0, "num_committed_tokens": 1},
        "off": {"num_spec_steps": 1, "num_accepted_draft_tokens": 0, "num_committed_tokens": 1}}
    assert out["per_step_accepted"] == [4, 0, 2, 0] and out["per_step_source"] == ["dlite", "suffix", "dlite", "off"]
    assert "per_step_accepted" not in _counts([(1, 4, "dlite")]).summary(3)  # summary: no per-step lists
    empty = S.SpecCounts(4).summary(1)
    assert empty["num_spec_steps"] == 0 and empty["mean_acceptance_length"] is None
    assert empty["draft_acceptance_rate"] is None


def test_merge_sums_choices_and_pools_tau():
    a = _counts([(4, 4, "dlite"), (1, 4, "dlite")]).summary(1 + 5 + 2)
    b = _counts([(0, 4, "suffix"), (3, 7, "mixed"), (2, 4, "dlite")], k=7).summary(1 + 1 + 4 + 3)
    m = S.merge([a, None, b])
    assert m["num_spec_steps"] == 5 and m["num_accepted_draft_tokens"] == 10 and m["num_draft_tokens"] == 23
    assert m["num_spec_tokens"] == 7 and sum(m["acceptance_histogram"]) == 5
    assert m["acceptance_histogram"] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert m["accepted_per_position"] == [4, 3, 2, 1, 0, 0, 0]
    assert m["tau"] == pytest.approx((7 + 8) / 5) and m["draft_acceptance_rate"] == 10 / 23
    assert m["sources"]["dlite"] == {"num_spec_steps": 3, "num_accepted_draft_tokens": 7, "num_committed_tokens": 10}
    assert S.merge([a]) is a and S.merge([None]) is None


def _req(value=None, finished=True, output=3):
    params = SimpleNamespace(custom_params=None if value is None else {S.REQUEST_KEY: value})
    return SimpleNamespace(sampling_params=params, finished=lambda: finished,
                           output_ids_through_stop=list(range(output)))


def test_who_gets_metrics_the_request_or_the_server(monkeypatch):
    monkeypatch.setitem(S._config, "num_spec_tokens", 4)
    for server, value, want in [("off", None, "off"), ("off", True, "summary"), ("off", "detailed", "detailed"),
                                ("summary", None, "summary"), ("summary", False, "off"), ("detailed", True, "detailed"),
                                ("off", "Summary", "summary")]:
        monkeypatch.setitem(S._config, "mode", server)
        assert S.mode_of(value, server) == want
        c = S.counts_of(_req(value))
        assert (c is None) == (want == "off") and (c is None or (c.per_step is not None) == (want == "detailed"))
    assert S.request_error(_req(True)) is None and S.request_error(_req("off")) is None
    assert S.request_error(_req()) is None
    for bad in ("verbose", 3, ["summary"]):
        msg = S.request_error(_req(bad))
        assert msg and "dlite_spec_metrics" in msg and "true, false or one of off, summary, detailed" in msg


def test_round_stats_counts_only_the_rounds_sglang_counts(monkeypatch):
    """``consume``: a request the round did not count (commit None) adds nothing; a chain verifies
    W - 1 drafts (0 for an opted-out request), a tree its nodes; the final summary only when finished."""
    monkeypatch.setitem(S._config, "mode", "summary")
    monkeypatch.setitem(S._config, "num_spec_tokens", 4)
    reqs = [_req(), _req(), _req(False)]
    rd = SimpleNamespace(tree=False, tokens=torch.zeros(3, 5), drafted=True, sources=["dlite", "suffix", "dlite"],
                         trees=[])
    stats = S.round_stats(rd, torch.tensor([2, 4, 1]), [False, True, False])
    assert stats.drafts == [4, 0, 4]
    host = stats.copy_to_host(lambda t: t.clone())
    host.consume(SimpleNamespace(reqs=reqs), [SimpleNamespace(token_ids=(1, 2, 3)), None,
                                              SimpleNamespace(token_ids=(1, 2))])
    s0 = S.final_summary(reqs[0])[0]
    assert s0["num_spec_steps"] == 1 and s0["num_accepted_draft_tokens"] == 2 and s0["sources"]["dlite"][
        "num_committed_tokens"] == 3
    assert S.final_summary(reqs[1])[0]["num_spec_steps"] == 0  # finished before the round
    assert S.final_summary(reqs[2]) == []  # opted out of the metrics
    assert S.final_summary(_req(finished=False)) == []
    tree = SimpleNamespace(tree=True, tokens=torch.zeros(2, 9), drafted=True, sources=["mixed", "dlite"],
                           trees=[list(range(9)), list(range(6))])
    assert S.round_stats(tree, [3, 1], None).drafts == [8, 5]  # a smaller tree's padding rows not counted


def test_streamed_responses_get_the_metrics_on_their_last_chunk():
    box = {0: _counts([(2, 4, "dlite")]).summary(4)}
    usage = 'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{}}\n\n'
    out = H.closing_chunks(usage, usage, box)
    assert len(out) == 1 and out[0].endswith("}\n\n")
    body = json.loads(out[0][len("data: "):])
    assert body["usage"] == {} and body["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] == 2
    assert H.closing_chunks('data: {"error": {"message": "boom"}}\n\n', usage, box) == [
        'data: {"error": {"message": "boom"}}\n\n']  # an error ends the stream as it is
    named = "event: x\ndata: 1\n\n"
    out = H.closing_chunks(named, usage, box)  # a chunk that cannot carry them: a metrics chunk after it
    assert out[0] == named and json.loads(out[1][len("data: "):])["choices"] == []
    assert H.closing_chunks(usage, usage, {}) == [usage]  # no metrics: unchanged
