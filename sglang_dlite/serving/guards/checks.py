"""Pure checks of a parsed JSON request body for the guarded routes (no sglang, no I/O): what
``RequestGuardMiddleware`` refuses before FastAPI parses the body. A refusal is ``RequestRefused``
(HTTP 400, ``param`` names the field); ``metric_field`` turns that field into a bounded metric label.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any, Iterable, Optional

GUARDED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class RequestRefused(ValueError):
    """A client error: HTTP 400 with ``message``; ``param`` names the offending field."""

    status_code = 400

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- pure checks
def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _type_name(x) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(x), type(x).__name__)


def _need(cond: bool, field: str, what: str, got=None):
    if not cond:
        tail = "" if got is None else f", got {json.dumps(got)[:60] if not isinstance(got, str) else repr(got[:60])}"
        raise RequestRefused(f"`{field}` {what}{tail}.", field)


def _check_prompt_text(text, field: str) -> None:
    if isinstance(text, str):
        _need(text.strip() != "", field, "is empty or whitespace only: send at least one visible character",
              text if text else None)
        return
    _need(isinstance(text, list), field, f"must be a string or a list of strings, not {_type_name(text)}")
    _need(len(text) > 0, field, "is an empty list: send at least one prompt")
    for i, t in enumerate(text):
        _need(isinstance(t, str), f"{field}[{i}]", f"must be a string, not {_type_name(t)}")
        _need(t.strip() != "", f"{field}[{i}]", "is empty or whitespace only: send at least one visible character")


def _check_token_ids(ids, field: str) -> None:
    _need(isinstance(ids, list), field, f"must be a list of token ids, not {_type_name(ids)}")
    _need(len(ids) > 0, field, "is empty: send at least one token id")
    if all(isinstance(x, list) for x in ids):  # a batch
        for i, row in enumerate(ids):
            _check_token_ids(row, f"{field}[{i}]")
        return
    for i, t in enumerate(ids):
        _need(is_int(t), f"{field}[{i}]", f"must be an integer token id, not {_type_name(t)}")
        _need(t >= 0, f"{field}[{i}]", "is a negative token id", t)


def _check_count(value, field: str, minimum: int, what: str = "") -> None:
    if value is None:
        return
    if isinstance(value, list):  # per-request values of a batch
        for i, v in enumerate(value):
            _check_count(v, f"{field}[{i}]", minimum, what)
        return
    _need(is_int(value), field, f"must be an integer, not {_type_name(value)}")
    _need(value >= minimum, field, what or f"must be at least {minimum}", value)


NUM_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
INT_PARAMS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "beam_width")
BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
STR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")


def _check_stop(stop, field: str) -> None:
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else stop
    _need(isinstance(items, list), field, f"must be a string or a list of strings, not {_type_name(stop)}")
    for i, s in enumerate(items):
        f = field if isinstance(stop, str) else f"{field}[{i}]"
        _need(isinstance(s, str), f, f"must be a string, not {_type_name(s)}")
        _need(s != "", f, "is an empty stop string (it would match before the first token)")


def _check_json_schema(schema, field: str) -> None:
    if schema is None:
        return
    _need(isinstance(schema, str), field, f"must be a JSON schema encoded as a string, not {_type_name(schema)}")
    try:
        json.loads(schema)
    except ValueError as exc:
        raise RequestRefused(f"`{field}` is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}).",
                             field) from None


def _check_custom_params(params, field: str) -> None:
    """DLITE's own key there: ``dlite_speculate`` (false: decode the request without drafts)."""
    if isinstance(params, dict) and "dlite_speculate" in params:
        _need(isinstance(params["dlite_speculate"], bool), f"{field}.dlite_speculate",
              "must be true or false (false: decode this request without speculation)", params["dlite_speculate"])


def check_sampling_params(sp, field: str = "sampling_params", known: Optional[Iterable[str]] = None) -> None:
    if sp is None:
        return
    if isinstance(sp, list):  # one per prompt of a batch
        for i, x in enumerate(sp):
            check_sampling_params(x, f"{field}[{i}]", known)
        return
    _need(isinstance(sp, dict), field, f"must be an object, not {_type_name(sp)}")
    if known is not None:
        known = set(known)
        for k in sp:
            if k not in known:
                near = difflib.get_close_matches(k, sorted(known), n=1)
                hint = f" (did you mean `{near[0]}`?)" if near else ""
                raise RequestRefused(f"`{field}.{k}` is not a sampling parameter{hint}.", f"{field}.{k}")
    for k in NUM_PARAMS:
        if sp.get(k) is not None:
            _need(_is_num(sp[k]), f"{field}.{k}", f"must be a finite number, not {_type_name(sp[k])}")
    for k in INT_PARAMS:
        if sp.get(k) is not None:
            _need(is_int(sp[k]), f"{field}.{k}", f"must be an integer, not {_type_name(sp[k])}")
    for k in BOOL_PARAMS:
        if sp.get(k) is not None:
            _need(isinstance(sp[k], bool), f"{field}.{k}", f"must be true or false, not {_type_name(sp[k])}")
    for k in STR_PARAMS:
        if sp.get(k) is not None:
            _need(isinstance(sp[k], str), f"{field}.{k}", f"must be a string, not {_type_name(sp[k])}")
    _check_count(sp.get("max_new_tokens"), f"{field}.max_new_tokens", 0)
    _check_count(sp.get("min_new_tokens"), f"{field}.min_new_tokens", 0)
    _check_count(sp.get("n"), f"{field}.n", 1)
    if sp.get("temperature") is not None:
        _need(sp["temperature"] >= 0, f"{field}.temperature", "must be >= 0", sp["temperature"])
    if sp.get("top_k") is not None:
        _need(sp["top_k"] == -1 or sp["top_k"] >= 1, f"{field}.top_k", "must be -1 (off) or at least 1", sp["top_k"])
    if sp.get("top_p") is not None:
        _need(0 < sp["top_p"] <= 1, f"{field}.top_p", "must be in (0, 1]", sp["top_p"])
    _check_stop(sp.get("stop"), f"{field}.stop")
    ids = sp.get("stop_token_ids")
    if ids is not None:
        _need(isinstance(ids, list), f"{field}.stop_token_ids", f"must be a list of token ids, not {_type_name(ids)}")
        for i, t in enumerate(ids):
            _need(is_int(t) and t >= 0, f"{field}.stop_token_ids[{i}]", "must be a non-negative integer token id", t)
    _check_json_schema(sp.get("json_schema"), f"{field}.json_schema")
    _check_custom_params(sp.get("custom_params"), f"{field}.custom_params")


def _check_generate(body: dict, known_fields, known_sampling) -> None:
    if known_fields is not None:
        unknown = [k for k in body if k not in known_fields]
        if unknown:
            k = unknown[0]
            near = difflib.get_close_matches(k, sorted(known_fields), n=1)
            hint = f" (did you mean `{near[0]}`?)" if near else ""
            if known_sampling is not None and k in set(known_sampling):
                hint = f" (`{k}` belongs inside `sampling_params`)"
            raise RequestRefused(f"`{k}` is not a field of /generate{hint}.", k)
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if not (has_text or has_ids or body.get("input_embeds") is not None):
        raise RequestRefused("the request has no prompt: send `text` or `input_ids`.", "text")
    if has_text:
        _check_prompt_text(body["text"], "text")
    if has_ids and not (body.get("session_params") and body["input_ids"] == []):
        _check_token_ids(body["input_ids"], "input_ids")
    _check_count(body.get("top_logprobs_num"), "top_logprobs_num", 0)
    _check_count(body.get("logprob_start_len"), "logprob_start_len", -1, "must be -1 (output only) or at least 0")
    if body.get("token_ids_logprob") is not None:
        _check_token_ids(body["token_ids_logprob"], "token_ids_logprob")
    if body.get("stream") is not None:
        _need(isinstance(body["stream"], bool), "stream", f"must be true or false, not {_type_name(body['stream'])}")
    check_sampling_params(body.get("sampling_params"), known=known_sampling)


def _check_openai_common(body: dict) -> None:
    for k in ("max_tokens", "max_completion_tokens"):
        _check_count(body.get(k), k, 1 if k == "max_tokens" else 0)
    _check_count(body.get("n"), "n", 1)
    for k in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
        if body.get(k) is not None:
            _need(_is_num(body[k]), k, f"must be a finite number, not {_type_name(body[k])}")
    if body.get("temperature") is not None:
        _need(body["temperature"] >= 0, "temperature", "must be >= 0", body["temperature"])
    _check_stop(body.get("stop"), "stop")
    if body.get("stream") is not None:
        _need(isinstance(body["stream"], bool), "stream", f"must be true or false, not {_type_name(body['stream'])}")
    _check_custom_params(body.get("custom_params"), "custom_params")


def _has_content(msg) -> bool:
    if not isinstance(msg, dict):
        return True  # let the schema check name the type error
    if msg.get("tool_calls"):
        return True
    c = msg.get("content")
    if isinstance(c, str):
        return c.strip() != ""
    if isinstance(c, list):
        for part in c:
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                return True
            if isinstance(part.get("text"), str) and part["text"].strip():
                return True
        return False
    return c is not None


def _check_chat(body: dict) -> None:
    msgs = body.get("messages")
    _need(msgs is not None, "messages", "is required: send a list of {role, content} messages")
    _need(isinstance(msgs, list), "messages", f"must be a list of messages, not {_type_name(msgs)}")
    _need(len(msgs) > 0, "messages", "is an empty list: send at least one message")
    if not any(_has_content(m) for m in msgs):
        raise RequestRefused("`messages[*].content` is empty or whitespace only in every message: "
                             "send at least one message with visible content.", "messages")
    _check_openai_common(body)
    _check_count(body.get("top_logprobs"), "top_logprobs", 0)
    if body.get("top_logprobs") is not None:
        _need(body["top_logprobs"] <= 20, "top_logprobs", "must be at most 20", body["top_logprobs"])
    rf = body.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict) and "schema" in rf["json_schema"]:
        _need(isinstance(rf["json_schema"]["schema"], (dict, bool)), "response_format.json_schema.schema",
              "must be a JSON schema object")


def _check_completions(body: dict) -> None:
    _need("prompt" in body, "prompt", "is required")
    p = body["prompt"]
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
        _check_prompt_text(p, "prompt")
    elif isinstance(p, list):
        _check_token_ids(p, "prompt")
    else:
        raise RequestRefused(f"`prompt` must be a string, a list of strings or a list of token ids, not {_type_name(p)}.",
                             "prompt")
    _check_openai_common(body)
    _check_count(body.get("logprobs"), "logprobs", 0)
    if body.get("logprobs") is not None:
        _need(body["logprobs"] <= 20, "logprobs", "must be at most 20", body["logprobs"])


def check_request(path: str, body: Any, *, known_generate_fields=None, known_sampling_params=None) -> None:
    """Raise RequestRefused when a parsed JSON body for ``path`` must not reach the server."""
    if not isinstance(body, dict):
        raise RequestRefused(f"the request body must be a JSON object, not {_type_name(body)}.", None)
    if path == "/generate":
        _check_generate(body, known_generate_fields, known_sampling_params)
    elif path == "/v1/chat/completions":
        _check_chat(body)
    elif path == "/v1/completions":
        _check_completions(body)


def _max_token_id(ids):
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return max((_max_token_id(r) for r in ids), default=None)
    return max(ids) if isinstance(ids, list) and ids and all(is_int(x) for x in ids) else None


def check_token_range(path: str, body: Any, vocab_size: Optional[int]) -> None:
    """Token ids the target's embedding has no row for (known once the server runs)."""
    if not vocab_size or not isinstance(body, dict):
        return
    field = {"/generate": "input_ids", "/v1/completions": "prompt"}.get(path)
    hi = _max_token_id(body.get(field)) if field else None
    if hi is not None and hi >= vocab_size:
        raise RequestRefused(f"`{field}` holds token id {hi}, outside the vocabulary [0, {vocab_size}).", field)


def check_tools_parser(path: str, body: Any, tool_call_parser) -> None:
    """``tools`` under ``tool_choice`` "auto" on a server with no tool-call parser: sglang would
    never answer with ``tool_calls`` (a call the model writes stays in ``content``). "required" and
    a named tool pass: sglang then constrains the output to a JSON array of calls, returned as
    ``content`` (test_sglang_verify checks that answer)."""
    if path != "/v1/chat/completions" or tool_call_parser or not isinstance(body, dict):
        return
    if body.get("tools") and body.get("tool_choice") in (None, "auto"):
        raise RequestRefused(
            "this server has no tool-call parser, so `tools` would never come back as `tool_calls`. "
            "Restart it with the parser that fits the target's chat template: sglang-dlite serve "
            "--model-path T -- --tool-call-parser NAME (e.g. qwen25, llama3, hermes; `auto` lets sglang "
            "detect it from the template), or send the request without `tools`.", "tools")


def parse_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise RequestRefused("malformed JSON: the body is not UTF-8 text.", None) from None
    except ValueError as exc:
        raise RequestRefused(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.", None) from None


OPENAI_FIELDS = {"messages", "prompt", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs",
                  "temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                  "stop", "stream", "response_format", "model", "tools"}


def metric_field(param, known_generate_fields=None, known_sampling_params=None) -> str:
    """A bounded label for the refused field (a client's unknown field names never become labels)."""
    if not param:
        return "body"
    parts = re.sub(r"\[\d+\]", "", str(param)).split(".")
    if parts[0] == "sampling_params" and len(parts) > 1:
        known = set(known_sampling_params or ()) | set(NUM_PARAMS + INT_PARAMS + STR_PARAMS) | {"stop", "stop_token_ids"}
        return f"sampling_params.{parts[1]}" if parts[1] in known else "sampling_params.unknown"
    known = set(known_generate_fields or ()) | OPENAI_FIELDS
    return parts[0] if parts[0] in known else "unknown_field"
