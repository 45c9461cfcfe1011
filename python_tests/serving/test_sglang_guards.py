"""Issue 18: the HTTP server survives every bad input a client sends (each gets a 400 with a short
message naming the field, no paths or tracebacks, and streaming requests get it as an SSE error
event), keeps answering afterwards, and serves DLITE's metrics with ``--enable-metrics``.

One real server (bundled SmolLM2 target + the shipped DLite drafter, ``--enable-metrics``) is
started for the whole module; the pure checks below it need no server."""

from __future__ import annotations

import json
import re
import time

import pytest

from dlite_lab.benchmarking.bad_requests import BAD_REQUESTS, LEAK_RE, error_message, send

requests = pytest.importorskip("requests")

GREEDY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}


# ----------------------------------------------------------------------------- pure checks
def _guards():
    from sglang_dlite.serving import guards

    return guards


@pytest.mark.parametrize("name,path,body,status,word", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_http_check_refuses_or_defers(name, path, body, status, word):
    """Every bad input is refused by the HTTP-layer check, except the three only the server can
    judge (vocabulary size, regex compilation, context length), which must pass through."""
    G = _guards()
    gen, sp = G.known_fields()
    server_only = {"generate-token-id-past-vocab", "generate-stream-token-id-past-vocab", "completions-token-id-past-vocab",
                   "generate-bad-regex", "generate-over-long-prompt"}
    try:
        G.check_request(path, G.parse_body(body) if isinstance(body, bytes) else body,
                        known_generate_fields=gen, known_sampling_params=sp)
    except G.RequestRefused as exc:
        assert name not in server_only
        assert word.lower() in str(exc).lower(), str(exc)
        return
    assert name in server_only, f"{name} was not refused"


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Hi", "stream": True, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1,
                   "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "stop": ["\n"], "n": 1,
                                       "json_schema": '{"type": "object"}', "stop_token_ids": [2]}}),
    ("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 2}]}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "system", "content": ""},
                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                              "logprobs": True, "top_logprobs": 3, "max_tokens": 5, "provider_specific": 1}),
    ("/v1/completions", {"model": "default", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 2, "stop": "x"}),
])
def test_http_check_lets_valid_requests_through(path, body):
    G = _guards()
    gen, sp = G.known_fields()
    G.check_request(path, body, known_generate_fields=gen, known_sampling_params=sp)


def test_token_range_needs_the_vocabulary():
    G = _guards()
    G.check_token_range("/generate", {"input_ids": [1, 99]}, 100)
    G.check_token_range("/generate", {"input_ids": [1, 100]}, None)  # before the server knows its vocabulary
    with pytest.raises(G.RequestRefused, match="outside the vocabulary"):
        G.check_token_range("/generate", {"input_ids": [[1], [5, 100]]}, 100)
    with pytest.raises(G.RequestRefused, match="prompt"):
        G.check_token_range("/v1/completions", {"prompt": [7, 1000]}, 100)


def test_messages_are_scrubbed():
    G = _guards()
    m = G.sanitize_message("Failed to compile regex grammar: [13:44:03] /project/cpp/regex_converter.cc:83: "
                           "Regex parsing error at position 3")
    assert m == "Failed to compile regex grammar: Regex parsing error at position 3"
    m = G.sanitize_message('1 validation error: x\n\n  File "/venv/lib/python3.11/site-packages/sglang/a.py", line 1')
    assert m == "1 validation error: x"
    assert not LEAK_RE.search(G.sanitize_message("cannot open /work/main/artifacts/cache/model/config.json"))
    assert len(G.sanitize_message("x" * 5000)) <= G.MAX_MESSAGE_CHARS
    msg, field = G.validation_errors_message([
        {"type": "string_type", "loc": ("body", "text", "str"), "msg": "Input should be a valid string"},
        {"type": "list_type", "loc": ("body", "text", "list[str]"), "msg": "Input should be a valid list"}])
    assert field == "text" and msg == "`text`: Input should be a valid string; `text`: Input should be a valid list"


def test_tokenizer_hook_refuses_zero_tokens_and_out_of_vocab_ids():
    """The tokenizer-manager check (also the Engine API's guard): 0 tokens after tokenization,
    ids outside the vocabulary, negative logprob counts."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput

    G = _guards()
    tm = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))

    def obj(**kw):
        o = GenerateReqInput(**kw)
        return o

    with pytest.raises(G.RequestRefused, match="0 tokens"):
        G.validate_tokenized(tm, obj(text="\u200b"), [])
    with pytest.raises(G.RequestRefused, match="outside the vocabulary"):
        G.validate_tokenized(tm, obj(input_ids=[1, 100]), [1, 100])
    with pytest.raises(G.RequestRefused, match="outside the vocabulary"):
        G.validate_tokenized(tm, obj(input_ids=[-1, 3]), [-1, 3])
    with pytest.raises(G.RequestRefused, match="top_logprobs_num"):
        G.validate_tokenized(tm, obj(input_ids=[1], top_logprobs_num=-3), [1])
    with pytest.raises(G.RequestRefused, match="whitespace"):
        G.validate_tokenized(tm, obj(text="   "), [22])
    assert G.validate_tokenized(tm, obj(input_ids=[1, 99], top_logprobs_num=2), [1, 99]) is None


def test_metrics_api_counts_rounds_and_sources():
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_dlite.serving import metrics as M

    assert M.enable(num_context_positions=4)
    reg = prometheus_client.REGISTRY

    def val(name, **labels):
        return reg.get_sample_value(name, labels) or 0.0

    before = (val("sglang:dlite_rounds_total"), val("sglang:dlite_source_rounds_total", source="dlite"),
              val("sglang:dlite_source_rounds_total", source="suffix"), val("sglang:dlite_draft_ms_count"),
              val("sglang:dlite_context_rows_count"))
    M.record_source("suffix", 3)
    M.record_round(draft_ms=2.5, verify_ms=10.0, batch_size=5, context_rows=[4, 4, 2, 0, 4])
    M.record_round(draft_ms=1.0, verify_ms=8.0, batch_size=2)
    after = (val("sglang:dlite_rounds_total"), val("sglang:dlite_source_rounds_total", source="dlite"),
             val("sglang:dlite_source_rounds_total", source="suffix"), val("sglang:dlite_draft_ms_count"),
             val("sglang:dlite_context_rows_count"))
    assert [a - b for a, b in zip(after, before)] == [2, 2 + 2, 3, 2, 5]
    # the round timer on CPU: three marks -> one recorded round with the right split
    t = M.RoundTimer("cpu").start()
    time.sleep(0.01)
    t.mark()
    t.mark()
    import torch

    le3 = val("sglang:dlite_context_rows_bucket", le="3.0")
    d0, v0 = val("sglang:dlite_draft_ms_sum"), val("sglang:dlite_verify_ms_sum")
    t.finish(2, torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    assert val("sglang:dlite_rounds_total") == after[0] + 1
    assert val("sglang:dlite_context_rows_count") == after[4] + 2
    assert val("sglang:dlite_context_rows_bucket", le="3.0") == le3 + 1  # one request had 3 valid rows
    assert val("sglang:dlite_draft_ms_sum") - d0 >= 9.0  # the 10 ms sleep was between start() and the draft mark
    assert val("sglang:dlite_verify_ms_sum") - v0 < 9.0
    # acceptance under vLLM's names, recorded where sglang takes a round's result (RoundStats.consume):
    # 3 requests verified 4 drafts each, accepting 0, 2 and 4; a 4th finished before the round (None)
    from types import SimpleNamespace

    from sglang_dlite.serving.spec_metrics import RoundStats

    names = ("sglang:spec_decode_num_drafts_total", "sglang:spec_decode_num_draft_tokens_total",
             "sglang:spec_decode_num_accepted_tokens_total")
    acc0 = [val(n) for n in names]
    pos0 = [val("sglang:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(4)]
    batch = SimpleNamespace(reqs=[SimpleNamespace(sampling_params=None) for _ in range(4)])
    commit = SimpleNamespace(token_ids=[1])
    RoundStats(torch.tensor([0, 2, 4, 3]), [4, 4, 4, 4], ["dlite"] * 4).consume(batch, [commit, commit, commit, None])
    assert [val(n) - v for n, v in zip(names, acc0)] == [3, 12, 6]
    pos = [val("sglang:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) - v for p, v in enumerate(pos0)]
    assert pos == [2, 2, 1, 1]
    RoundStats([0, 0, 0, 0], [0, 0, 0, 0], ["dlite"] * 4).consume(batch, [commit] * 4)  # no drafts: not a draft
    assert [val(n) - v for n, v in zip(names, acc0)] == [3, 12, 6]


def test_round_log_records_every_round_without_metrics(tmp_path, monkeypatch):
    """The setting round_log: the worker gets a round timer without --enable-metrics, and each
    finished round appends its batch size and draft / verify split as one JSON line."""
    import argparse
    import json

    from sglang_dlite.serving import metrics as M

    log = tmp_path / "rounds.jsonl"
    args = argparse.Namespace(enable_metrics=False)
    monkeypatch.setattr(M, "metrics_requested", lambda server_args: False)
    monkeypatch.delenv("SGLANG_DLITE_CONFIG", raising=False)
    assert M.worker_timer(args, "cpu", 4) is None
    monkeypatch.setenv("SGLANG_DLITE_CONFIG", json.dumps({"round_log": str(log)}))
    assert M.worker_timer(args, "cpu", 4, tp_rank=1) is None  # rank 0 records for all
    t = M.worker_timer(args, "cpu", 4)
    for bs in (3, 1):
        t.start()
        time.sleep(0.01)
        t.mark()
        t.mark()
        t.finish(bs)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["bs"] for r in recs] == [3, 1]
    assert all(r["draft_ms"] >= 9.0 and 0 <= r["verify_ms"] < 9.0 for r in recs)


def test_serve_cpu_fixes_the_malloc_mmap_threshold(tmp_path, monkeypatch):
    """The soak's fix: a fixed glibc mmap threshold keeps the CPU scheduler's RSS flat; a value
    the caller set is kept."""
    import argparse

    from sglang_dlite.serving import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    args = p.parse_args(["--model-path", str(tmp_path), "--no-spec", "--cpu", "--dry-run"])
    assert serve.build_command(args)[1]["MALLOC_MMAP_THRESHOLD_"] == "131072"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert serve.build_command(args)[1]["MALLOC_MMAP_THRESHOLD_"] == "4096"
    args = p.parse_args(["--model-path", str(tmp_path), "--no-spec", "--dry-run"])
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in serve.build_command(args)[1]  # CUDA deployments: untouched


def test_serve_cpu_binds_a_core_list_per_rank(tmp_path, monkeypatch, capsys):
    """`serve --cpu -- --tp-size 2` sets sglang's SGLANG_CPU_OMP_THREADS_BIND itself (sglang asserts it
    when ranks outnumber NUMA nodes), splitting the cores evenly over TP x DP; a value set wins."""
    import argparse

    from sglang_dlite.serving import cpu_launch
    from sglang_dlite.serving import serve

    assert cpu_launch.omp_threads_bind(2, ncpu=2) == "0|1"
    assert cpu_launch.omp_threads_bind(2, ncpu=16) == "0-7|8-15"
    assert cpu_launch.omp_threads_bind(4, ncpu=16) == "0-3|4-7|8-11|12-15"
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(cpu_launch.os, "cpu_count", lambda: 8)
    for extra, want in ((["--tp-size", "2"], "0-3|4-7"), (["--tp-size=2", "--dp-size", "2"], "0-1|2-3|4-5|6-7"),
                        (["--port", "8000"], None)):
        args = p.parse_args(["--model-path", str(tmp_path), "--no-spec", "--cpu", "--dry-run", "--", *extra])
        assert serve.build_command(args)[1].get("SGLANG_CPU_OMP_THREADS_BIND") == want
    assert "2 ranks on cores 0-3|4-7" in capsys.readouterr().err
    from sglang_dlite.errors import DLiteInputError

    args = p.parse_args(["--model-path", str(tmp_path), "--no-spec", "--cpu", "--dry-run", "--", "--tp-size", "two"])
    with pytest.raises(DLiteInputError, match="--tp-size 'two': give a whole number of ranks"):
        serve.build_command(args)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    args = p.parse_args(["--model-path", str(tmp_path), "--no-spec", "--cpu", "--dry-run", "--", "--tp-size", "2"])
    assert serve.build_command(args)[1]["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"


# ----------------------------------------------------------------------------- one real server
@pytest.fixture(scope="module")
def server(dlite_http_server):
    """The session's DLITE server (conftest) and its greedy answer to GREEDY before any bad input."""
    srv = dlite_http_server
    r = requests.post(srv.base + "/generate", json=GREEDY, timeout=300)
    assert r.status_code == 200, r.text
    return srv.base, srv.proc, srv.log, r.json()["text"]


def _alive(base, proc, log):
    if proc.poll() is not None:
        log.seek(0)
        pytest.fail("the server process died:\n" + log.read()[-3000:])
    assert requests.get(base + "/health", timeout=60).status_code == 200


@pytest.mark.parametrize("name,path,body,status,word", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_4xx_with_readable_message(server, name, path, body, status, word):
    base, proc, log, _ = server
    r = send(requests, base, path, body, timeout=120)
    msg = error_message(r)
    assert r.status_code == status, f"{name}: HTTP {r.status_code}: {r.text[:300]}"
    if isinstance(body, dict) and body.get("stream"):
        # a refused streaming request: the same message as one SSE error event, then [DONE]
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln[len("data: "):] for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[0])["error"]
        assert err["code"] == 400
        msg = err["message"]
    assert word.lower() in msg.lower(), f"{name}: message does not name `{word}`: {msg!r}"
    assert not LEAK_RE.search(msg), f"{name}: message leaks internals: {msg!r}"
    assert len(msg) <= 400
    _alive(base, proc, log)


def test_server_still_answers_after_bad_inputs(server):
    base, proc, log, first = server
    for name, path, body, _, _ in BAD_REQUESTS:  # every bad input once more, back to back
        send(requests, base, path, body, timeout=120)
    _alive(base, proc, log)
    r = requests.post(base + "/generate", json=GREEDY, timeout=300)
    assert r.status_code == 200 and r.json()["text"] == first  # greedy: the same answer as before
    r = requests.post(base + "/v1/chat/completions", timeout=300, json={
        "model": "default", "temperature": 0, "max_tokens": 8, "stream": True,
        "messages": [{"role": "user", "content": "Say hello."}]})
    assert r.status_code == 200 and "[DONE]" in r.text and '"error"' not in r.text


def test_tools_without_a_tool_call_parser_get_a_clear_400(server):
    """This server has no --tool-call-parser (``sglang-dlite serve`` passes one for the bundled
    target only): ``tools`` under "auto" would never come back as ``tool_calls``."""
    base, proc, log, _ = server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and "--tool-call-parser" in error_message(r), r.text[:300]
    assert requests.post(base + "/v1/chat/completions", json=dict(body, tool_choice="none"), timeout=300).status_code == 200
    _alive(base, proc, log)


def test_metrics_serve_dlite_and_spec_counters(server):
    base, proc, log, _ = server
    assert requests.post(base + "/generate", json={"text": " "}, timeout=60).status_code == 400
    r = requests.post(base + "/generate", timeout=300, json={
        "text": ["Count to ten:", "List three fruits:"], "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
    assert r.status_code == 200, r.text
    text = ""
    for _ in range(20):  # the multiprocess collector reads the scheduler's files
        text = requests.get(base + "/metrics", timeout=30).text
        if re.search(r"^sglang:dlite_draft_ms_count(\{[^}]*\})? [1-9]", text, re.M):
            break
        time.sleep(0.5)

    def value(pattern):
        m = re.search(r"^" + pattern + r"(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
        assert m, f"{pattern} not in /metrics"
        return float(m.group(1))

    rounds = value("sglang:dlite_rounds_total")
    assert rounds >= 5
    assert value("sglang:dlite_draft_ms_count") == rounds and value("sglang:dlite_verify_ms_count") == rounds
    assert value("sglang:dlite_draft_ms_sum") > 0 and value("sglang:dlite_verify_ms_sum") > 0
    assert value("sglang:dlite_context_rows_count") >= rounds
    sources = dict(re.findall(r'^sglang:dlite_source_rounds_total\{[^}]*source="([^"]+)"[^}]*\} ([0-9.e+]+)$', text, re.M))
    assert sources and sum(float(v) for v in sources.values()) >= rounds
    assert value("sglang:spec_verify_calls_total") >= 1  # sglang's own spec counter is there too
    drafts, accepted = value("sglang:spec_decode_num_drafts_total"), value("sglang:spec_decode_num_accepted_tokens_total")
    # (a round the CPU's draft gate ran without drafts is not a draft: fewer drafts than rounds is fine)
    assert drafts > 0 and value("sglang:spec_decode_num_draft_tokens_total") >= drafts
    per_pos = dict(re.findall(r'^sglang:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} '
                              r'([0-9.e+]+)$', text, re.M))
    assert per_pos and sum(float(v) for v in per_pos.values()) == accepted > 0
    assert re.search(r'^sglang:dlite_refused_requests_total\{[^}]*endpoint="/generate"[^}]*field="text"[^}]*\} [1-9]',
                     text, re.M), "the guards' refusal counter"
    _alive(base, proc, log)
