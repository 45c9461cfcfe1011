"""Requests a client may send that the server must refuse with a 4xx and a readable message
(issue 18). Shared by python_tests/serving/test_sglang_guards.py and bench/soak.py (the chaos client),
which import it from the package.

Each entry: (name, method path, body, expected status, a word the message must contain).
A body given as ``bytes`` is sent raw (malformed JSON); anything else is sent as JSON.
"""

from __future__ import annotations

import re

# The message of a refused request must not leak server internals (tracebacks, source paths).
LEAK_RE = re.compile(r'Traceback|File "|site-packages|/(?:[\w.+-]+/)+[\w.+-]+\.(?:py|cc|cpp|cu|h)\b|\.py\b')

BAD_REQUESTS = [
    # --- prompts that would reach the model as zero tokens (one of them killed the whole server) ---
    ("generate-empty-text", "/generate", {"text": "", "sampling_params": {"max_new_tokens": 8}}, 400, "text"),
    ("generate-whitespace-text", "/generate", {"text": "  \n\t ", "sampling_params": {"max_new_tokens": 8}}, 400, "text"),
    ("generate-batch-empty-text", "/generate", {"text": ["Hello", ""], "sampling_params": {"max_new_tokens": 4}}, 400, "text"),
    ("generate-empty-input-ids", "/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 8}}, 400, "input_ids"),
    ("generate-batch-empty-input-ids", "/generate", {"input_ids": [[1, 2, 3], []], "sampling_params": {"max_new_tokens": 4}}, 400, "input_ids"),
    ("generate-no-prompt", "/generate", {"sampling_params": {"max_new_tokens": 8}}, 400, "text"),
    ("generate-stream-empty-text", "/generate", {"text": "", "stream": True, "sampling_params": {"max_new_tokens": 8}}, 400, "text"),
    # --- token ids the embedding cannot look up ---
    ("generate-negative-token-id", "/generate", {"input_ids": [1, -5, 3], "sampling_params": {"max_new_tokens": 4}}, 400, "input_ids"),
    ("generate-token-id-past-vocab", "/generate", {"input_ids": [1, 10_000_000], "sampling_params": {"max_new_tokens": 4}}, 400, "input_ids"),
    ("generate-stream-token-id-past-vocab", "/generate", {"input_ids": [1, 10_000_000], "stream": True, "sampling_params": {"max_new_tokens": 4}}, 400, "input_ids"),
    ("completions-token-id-past-vocab", "/v1/completions", {"model": "default", "prompt": [1, 10_000_000], "max_tokens": 4}, 400, "prompt"),
    # --- negative counts ---
    ("generate-negative-top-logprobs", "/generate", {"text": "Hi", "return_logprob": True, "top_logprobs_num": -3, "sampling_params": {"max_new_tokens": 4}}, 400, "top_logprobs_num"),
    ("generate-negative-logprob-start", "/generate", {"text": "Hi", "return_logprob": True, "logprob_start_len": -7, "sampling_params": {"max_new_tokens": 4}}, 400, "logprob_start_len"),
    ("generate-negative-max-new-tokens", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("generate-negative-min-new-tokens", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": -2}}, 400, "min_new_tokens"),
    ("generate-zero-n", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "n": 0}}, 400, "n"),
    ("generate-negative-temperature", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": -1}}, 400, "temperature"),
    ("generate-zero-top-k", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "top_k": 0}}, 400, "top_k"),
    ("generate-top-p-zero", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "top_p": 0}}, 400, "top_p"),
    ("generate-empty-stop-string", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "stop": [""]}}, 400, "stop"),
    ("generate-negative-stop-token-id", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [-4]}}, 400, "stop_token_ids"),
    # --- wrong types, unknown fields, malformed bodies ---
    ("generate-wrong-type-temperature", "/generate", {"text": "Hi", "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
    ("generate-wrong-type-text", "/generate", {"text": 123, "sampling_params": {"max_new_tokens": 4}}, 400, "text"),
    ("generate-unknown-sampling-param", "/generate", {"text": "Hi", "sampling_params": {"max_tokens": 4}}, 400, "max_tokens"),
    ("generate-unknown-top-level-field", "/generate", {"text": "Hi", "max_new_tokens": 4}, 400, "max_new_tokens"),
    ("generate-malformed-json", "/generate", b'{"text": "Hi", "sampling_params": {', 400, "JSON"),
    ("generate-body-not-object", "/generate", ["Hi"], 400, "object"),
    ("generate-bad-json-schema", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "json_schema": "{not json"}}, 400, "json_schema"),
    ("generate-bad-regex", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "regex": "(("}}, 400, "regex"),
    ("generate-over-long-prompt", "/generate", {"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 4}}, 400, "context"),
    # --- OpenAI completions ---
    ("completions-empty-prompt", "/v1/completions", {"model": "default", "prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("completions-whitespace-prompt", "/v1/completions", {"model": "default", "prompt": " \n ", "max_tokens": 4}, 400, "prompt"),
    ("completions-empty-prompt-ids", "/v1/completions", {"model": "default", "prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("completions-negative-max-tokens", "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions-negative-logprobs", "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 4, "logprobs": -2}, 400, "logprobs"),
    ("completions-zero-n", "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 4, "n": 0}, 400, "n"),
    ("completions-wrong-type-prompt", "/v1/completions", {"model": "default", "prompt": 12, "max_tokens": 4}, 400, "prompt"),
    ("completions-malformed-json", "/v1/completions", b'{"prompt": ', 400, "JSON"),
    ("completions-stream-empty-prompt", "/v1/completions", {"model": "default", "prompt": "", "max_tokens": 4, "stream": True}, 400, "prompt"),
    # --- OpenAI chat ---
    ("chat-empty-messages", "/v1/chat/completions", {"model": "default", "messages": [], "max_tokens": 4}, 400, "messages"),
    ("chat-missing-messages", "/v1/chat/completions", {"model": "default", "max_tokens": 4}, 400, "messages"),
    ("chat-empty-content", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": ""}], "max_tokens": 4}, 400, "content"),
    ("chat-whitespace-content", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "   "}], "max_tokens": 4}, 400, "content"),
    ("chat-negative-top-logprobs", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("chat-negative-max-tokens", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": -5}, 400, "max_tokens"),
    ("chat-zero-n", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 0}, 400, "n"),
    ("chat-wrong-type-messages", "/v1/chat/completions", {"model": "default", "messages": "Hi", "max_tokens": 4}, 400, "messages"),
    ("chat-malformed-json", "/v1/chat/completions", b"{not json", 400, "JSON"),
    ("chat-stream-empty-messages", "/v1/chat/completions", {"model": "default", "messages": [], "max_tokens": 4, "stream": True}, 400, "messages"),
    # --- DLITE's per-request opt-out takes JSON true / false only ---
    ("generate-opt-out-not-bool", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "custom_params": {"dlite_speculate": "no"}}}, 400, "dlite_speculate"),
    ("chat-opt-out-not-bool", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "custom_params": {"dlite_speculate": 0}}, 400, "dlite_speculate"),
]


def send(session, base: str, path: str, body, timeout: float = 120):
    """POST one bad request; returns the ``requests.Response``."""
    if isinstance(body, (bytes, bytearray)):
        return session.post(base + path, data=bytes(body), timeout=timeout,
                            headers={"Content-Type": "application/json"})
    return session.post(base + path, json=body, timeout=timeout)


def error_message(resp) -> str:
    """The client-facing message of a refused request (JSON body or a streamed error event)."""
    text = resp.text
    try:
        body = resp.json()
    except ValueError:
        return text
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(err, str):
            return err
        return str(body.get("message", body))
    return text
