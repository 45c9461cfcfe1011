"""`python -m sglang.launch_server ... --speculative-algorithm DLITE` on 127.0.0.1 with the real
default target (SmolLM2-135M-Instruct): OpenAI-compatible chat, sampling, and aborts that leave
the server serving with no leaked KV slots (the scheduler runs with
SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1, so a leaked slot crashes it at the next idle check)."""

from __future__ import annotations

import time

import pytest

requests = pytest.importorskip("requests")


@pytest.fixture(scope="module")
def server(dlite_http_server):
    """The session's DLITE server (conftest: shared with test_sglang_guards)."""
    return dlite_http_server.base, dlite_http_server.proc, dlite_http_server.log


def _alive(base, proc):
    assert proc.poll() is None, "the server process died"
    assert requests.get(base + "/health", timeout=30).status_code == 200


def test_openai_chat_completions(server):
    base, proc, _ = server
    r = requests.post(base + "/v1/chat/completions", timeout=300, json={
        "model": "default", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    text = body["choices"][0]["message"]["content"]
    assert text and body["usage"]["completion_tokens"] > 0
    # the same request through the OpenAI client
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    out = client.chat.completions.create(model="default", temperature=0, max_tokens=24,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert out.choices[0].message.content == text  # greedy: deterministic


def test_native_generate_matches_reference_and_sampling_runs(server):
    base, proc, _ = server
    from transformers import AutoTokenizer

    from sglang_dlite.model.bundled_target import prepare_default_target

    target = str(prepare_default_target(verbose=False))
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                  add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    r = requests.post(base + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    got = r.json()["output_ids"]
    assert len(got) == 16
    r = requests.post(base + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16}})
    assert r.status_code == 200, r.text
    assert 1 <= len(r.json()["output_ids"]) <= 16
    _alive(base, proc)


def test_abort_mid_generation_keeps_serving_and_leaks_nothing(server):
    base, proc, _ = server
    # 1) client disconnect mid-stream
    with requests.post(base + "/generate", stream=True, timeout=300, json={
        "text": "Tell me a very long story about a robot.", "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}) as r:
        chunks = 0
        for line in r.iter_lines():
            if line:
                chunks += 1
            if chunks >= 3:
                break
    # 2) explicit abort by request id, while it decodes next to another request
    import threading

    res = {}

    def long_req():
        res["r"] = requests.post(base + "/generate", timeout=300, json={
            "text": "Count from one to one thousand.", "rid": "dlite-abort-me",
            "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}})

    th = threading.Thread(target=long_req)
    th.start()
    time.sleep(3)
    a = requests.post(base + "/abort_request", json={"rid": "dlite-abort-me"}, timeout=30)
    assert a.status_code == 200, a.text
    th.join(120)
    assert not th.is_alive()
    meta = res["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 2000
    # idle long enough for the strict idle memory check, then serve again
    time.sleep(4)
    _alive(base, proc)
    r = requests.post(base + "/generate", timeout=300, json={
        "text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    time.sleep(2)
    _alive(base, proc)
