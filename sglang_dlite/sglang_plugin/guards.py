"""Request guards and client-readable errors for the HTTP server (issue 18).

sglang 0.5.23 lets a few inputs through that reach the model as zero tokens or as an id the
embedding cannot look up; each of them kills the scheduler, and with it the whole server
(``{"text": ""}``: 0-token prefill; ``{"input_ids": [1, -5]}``: embedding index error). Others are
accepted and silently ignored (``top_logprobs_num: -3``, an unknown top-level field), or refused
with a body that holds a raw validation dump with the server's file paths.

Three layers, all installed by the plugin (no sglang source edits), none in the scheduler:

1. ``check_request(path, body)``: pure checks of a parsed JSON body for ``/generate``,
   ``/v1/completions`` and ``/v1/chat/completions`` (empty / whitespace-only prompts, empty
   message lists, negative or zero counts, negative token ids, empty stop strings, wrong types,
   unknown fields of ``/generate``, a ``json_schema`` that is not JSON). Run by
   ``RequestGuardMiddleware`` (a pure ASGI middleware) before FastAPI parses the body, so it also
   answers malformed JSON with a short message. A refused request gets HTTP 400 with
   ``{"object": "error", "message": ..., "type": "BadRequestError", "param": FIELD, "code": 400}``;
   a refused ``"stream": true`` request gets HTTP 400 with the same object as one SSE error event
   (``data: {"error": {...}}`` then ``data: [DONE]``).
2. ``validate_tokenized`` (a BEFORE hook on ``TokenizerManager._validate_one_request``): what only
   the tokenizer knows: a prompt that tokenizes to 0 tokens, token ids outside the target's
   vocabulary; plus the negative logprob counts for the Python ``Engine`` API, which has no HTTP
   layer.
3. ``sanitize_message``: every 4xx JSON body (and every SSE error event) on the guarded routes
   leaves without file paths, tracebacks or log timestamps; FastAPI's validation errors are
   rewritten as ``field `a.b`: what was wrong``.

Unknown top-level fields: refused on ``/generate`` (sglang's native API: a top-level
``max_new_tokens`` would otherwise be ignored and the request would run with the default 128);
ignored on the OpenAI-compatible routes, as sglang does (OpenAI SDKs and agents send
provider-specific fields; refusing them would break clients).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

GUARDED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
MAX_MESSAGE_CHARS = 400


class RequestRefused(ValueError):
    """A client error: HTTP 400 with ``message``; ``param`` names the offending field."""

    status_code = 400

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- pure checks
def _is_int(x) -> bool:
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
        _need(_is_int(t), f"{field}[{i}]", f"must be an integer token id, not {_type_name(t)}")
        _need(t >= 0, f"{field}[{i}]", "is a negative token id", t)


def _check_count(value, field: str, minimum: int, what: str = "") -> None:
    if value is None:
        return
    if isinstance(value, list):  # per-request values of a batch
        for i, v in enumerate(value):
            _check_count(v, f"{field}[{i}]", minimum, what)
        return
    _need(_is_int(value), field, f"must be an integer, not {_type_name(value)}")
    _need(value >= minimum, field, what or f"must be at least {minimum}", value)


_NUM_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_PARAMS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "beam_width")
_BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")


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
    for k in _NUM_PARAMS:
        if sp.get(k) is not None:
            _need(_is_num(sp[k]), f"{field}.{k}", f"must be a finite number, not {_type_name(sp[k])}")
    for k in _INT_PARAMS:
        if sp.get(k) is not None:
            _need(_is_int(sp[k]), f"{field}.{k}", f"must be an integer, not {_type_name(sp[k])}")
    for k in _BOOL_PARAMS:
        if sp.get(k) is not None:
            _need(isinstance(sp[k], bool), f"{field}.{k}", f"must be true or false, not {_type_name(sp[k])}")
    for k in _STR_PARAMS:
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
            _need(_is_int(t) and t >= 0, f"{field}.stop_token_ids[{i}]", "must be a non-negative integer token id", t)
    _check_json_schema(sp.get("json_schema"), f"{field}.json_schema")


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
    return max(ids) if isinstance(ids, list) and ids and all(_is_int(x) for x in ids) else None


def check_token_range(path: str, body: Any, vocab_size: Optional[int]) -> None:
    """Token ids the target's embedding has no row for (known once the server runs)."""
    if not vocab_size or not isinstance(body, dict):
        return
    field = {"/generate": "input_ids", "/v1/completions": "prompt"}.get(path)
    hi = _max_token_id(body.get(field)) if field else None
    if hi is not None and hi >= vocab_size:
        raise RequestRefused(f"`{field}` holds token id {hi}, outside the vocabulary [0, {vocab_size}).", field)


def parse_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise RequestRefused("malformed JSON: the body is not UTF-8 text.", None) from None
    except ValueError as exc:
        raise RequestRefused(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.", None) from None


# ----------------------------------------------------------------------------- messages
_TRACE_CUT = re.compile(r"(\n\s*File \"|Traceback \(most recent call last\))")
_TIMESTAMP = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s*")
_SRC_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.+-]+)+\.(?:py|pyx|cc|cpp|cu|h|hpp|c|rs)(?::\d+)*:?\s*")
_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/){2,}[\w.+-]*")


def sanitize_message(msg: Any) -> str:
    """A client-facing error message: no tracebacks, source paths, file-system paths or log
    timestamps, at most MAX_MESSAGE_CHARS characters."""
    s = str(msg)
    m = _TRACE_CUT.search(s)
    if m:
        s = s[: m.start()]
    s = _TIMESTAMP.sub("", s)
    s = _SRC_PATH.sub("", s)
    s = _ABS_PATH.sub("<path>", s)
    s = " ".join(s.split())
    if len(s) > MAX_MESSAGE_CHARS:
        s = s[: MAX_MESSAGE_CHARS - 1] + "…"
    return s or "invalid request"


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|List\[.*\]|Dict\[.*\]|function-.*|.*\[.*\])$")


def validation_errors_message(errors: list) -> tuple:
    """FastAPI/pydantic ``exc.errors()`` -> (short message, first field)."""
    parts, first = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            why = (e.get("ctx") or {}).get("error", "cannot be parsed")
            return f"malformed JSON: {why}.", None
        if e.get("type") in ("dataclass_type", "model_type", "dict_type") and not loc:
            return "the request body must be a JSON object.", None
        loc = [x for i, x in enumerate(loc) if i == 0 or not _UNION_TAG.match(x)]
        field = ".".join(loc) or "body"
        msg = str(e.get("msg", "is invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        item = f"`{field}`: {msg}"
        if item not in parts:
            parts.append(item)
        first = first or field
        if len(parts) == 3:
            break
    return sanitize_message("; ".join(parts) or "invalid request"), first


def error_body(message: str, param: Optional[str] = None) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": param, "code": 400}


_OPENAI_FIELDS = {"messages", "prompt", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs",
                  "temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                  "stop", "stream", "response_format", "model"}


def metric_field(param, known_generate_fields=None, known_sampling_params=None) -> str:
    """A bounded label for the refused field (a client's unknown field names never become labels)."""
    if not param:
        return "body"
    parts = re.sub(r"\[\d+\]", "", str(param)).split(".")
    if parts[0] == "sampling_params" and len(parts) > 1:
        known = set(known_sampling_params or ()) | set(_NUM_PARAMS + _INT_PARAMS + _STR_PARAMS) | {"stop", "stop_token_ids"}
        return f"sampling_params.{parts[1]}" if parts[1] in known else "sampling_params.unknown"
    known = set(known_generate_fields or ()) | _OPENAI_FIELDS
    return parts[0] if parts[0] in known else "unknown_field"


# ----------------------------------------------------------------------------- ASGI middleware
class RequestGuardMiddleware:
    """Pure ASGI: checks the guarded routes' JSON bodies before FastAPI sees them, and scrubs the
    messages of every 4xx JSON body / SSE error event they answer with."""

    def __init__(self, app, known_generate_fields=None, known_sampling_params=None, vocab_size=None):
        self.app = app
        self.vocab_size = vocab_size  # callable -> the target's vocabulary size, or None
        self.known_generate_fields = known_generate_fields
        self.known_sampling_params = known_sampling_params

    async def __call__(self, scope, receive, send):
        if (scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT")
                or scope.get("path") not in GUARDED_PATHS):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        stream = False
        if not headers.get("content-encoding"):  # compressed bodies: sglang decompresses them later
            try:
                body = parse_body(raw)
                stream = isinstance(body, dict) and body.get("stream") is True
                check_request(scope["path"], body, known_generate_fields=self.known_generate_fields,
                              known_sampling_params=self.known_sampling_params)
                check_token_range(scope["path"], body, self.vocab_size() if self.vocab_size else None)
            except RequestRefused as exc:
                try:
                    from .metrics import record_refusal

                    record_refusal(scope["path"], metric_field(exc.param, self.known_generate_fields,
                                                              self.known_sampling_params))
                except Exception:  # pragma: no cover - metrics must never break a refusal
                    pass
                return await self._refuse(send, sanitize_message(exc), exc.param, stream)

        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, _ScrubbingSend(send))

    @staticmethod
    async def _refuse(send, message: str, param, stream: bool):
        if stream:
            event = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}
            payload = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
            ctype = b"text/event-stream"
        else:
            payload = json.dumps(error_body(message, param)).encode()
            ctype = b"application/json"
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def _scrub_json(obj):
    if isinstance(obj, dict):
        return {k: (sanitize_message(v) if k in ("message", "detail", "error") and isinstance(v, str) else _scrub_json(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub_json(x) for x in obj]
    return obj


class _ScrubbingSend:
    """Wraps ASGI ``send``: 4xx JSON bodies are buffered and their messages scrubbed; SSE error
    events (``data: {"error": ...}``) of a streaming answer are scrubbed in place."""

    def __init__(self, send):
        self.send = send
        self.start = None
        self.buffer = []
        self.mode = "pass"

    async def __call__(self, message):
        t = message["type"]
        if t == "http.response.start":
            status = message.get("status", 200)
            hdrs = {k.lower(): v for k, v in message.get("headers", [])}
            ctype = hdrs.get(b"content-type", b"")
            if 400 <= status < 500 and b"json" in ctype:
                self.mode, self.start = "json4xx", message
                return
            if b"event-stream" in ctype:
                self.mode = "sse"
            return await self.send(message)
        if t == "http.response.body" and self.mode == "json4xx":
            self.buffer.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            raw = b"".join(self.buffer)
            try:
                raw = json.dumps(_scrub_json(json.loads(raw))).encode()
            except ValueError:
                raw = json.dumps(error_body(sanitize_message(raw.decode("utf-8", "replace")))).encode()
            headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(raw)).encode()))
            await self.send(dict(self.start, headers=headers))
            return await self.send({"type": "http.response.body", "body": raw, "more_body": False})
        if t == "http.response.body" and self.mode == "sse":
            body = message.get("body", b"")
            if b'"error"' in body and body.startswith(b"data: {"):
                try:
                    events = []
                    for line in body.split(b"\n\n"):
                        if line.startswith(b"data: {") and b'"error"' in line:
                            line = b"data: " + json.dumps(_scrub_json(json.loads(line[6:]))).encode()
                        events.append(line)
                    message = dict(message, body=b"\n\n".join(events))
                except ValueError:
                    pass
        return await self.send(message)


# ----------------------------------------------------------------------------- sglang hooks
def validate_tokenized(tm, obj, input_ids, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager._validate_one_request(self, obj, input_ids)``."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if not isinstance(obj, GenerateReqInput):
        return None
    if getattr(obj, "input_embeds", None) is None and input_ids is not None:
        if len(input_ids) == 0:
            field = "text" if getattr(obj, "text", None) is not None else "input_ids"
            raise RequestRefused(f"`{field}` is empty after tokenization (0 tokens): send at least one token.", field)
        vocab = getattr(getattr(tm, "model_config", None), "vocab_size", None)
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or (vocab is not None and hi >= vocab):
            bad = lo if lo < 0 else hi
            raise RequestRefused(f"`input_ids` holds token id {bad}, outside the vocabulary [0, {vocab}).", "input_ids")
    text = getattr(obj, "text", None)
    if isinstance(text, str) and not text.strip() and not obj.contains_mm_input():
        raise RequestRefused("`text` is empty or whitespace only: send at least one visible character.", "text")
    n = getattr(obj, "top_logprobs_num", None)
    if _is_int(n) and n < 0:
        raise RequestRefused(f"`top_logprobs_num` must be at least 0, got {n}.", "top_logprobs_num")
    s = getattr(obj, "logprob_start_len", None)
    if _is_int(s) and s < -1:
        raise RequestRefused(f"`logprob_start_len` must be -1 (output only) or at least 0, got {s}.", "logprob_start_len")
    return None


def _known_fields():
    import dataclasses

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    gen = {f.name for f in dataclasses.fields(GenerateReqInput)}
    sp = set(getattr(SamplingParams, "__struct_fields__", ()))
    # set by normalize(), never by a client
    sp -= {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"}
    return gen, (sp or None)


def install_http_guards(*args, **kwargs):
    """BEFORE hook on ``http_server.launch_server``: the middleware and the validation-error
    handler are added to sglang's FastAPI app before uvicorn starts it."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import ORJSONResponse

    from sglang.srt.entrypoints import http_server

    app = http_server.app
    if getattr(app.state, "dlite_guards", False):
        return None
    gen, sp = _known_fields()

    def vocab_size():
        tm = getattr(getattr(http_server, "_global_state", None), "tokenizer_manager", None)
        return getattr(getattr(tm, "model_config", None), "vocab_size", None)

    app.add_middleware(RequestGuardMiddleware, known_generate_fields=gen, known_sampling_params=sp,
                       vocab_size=vocab_size)
    original = app.exception_handlers.get(RequestValidationError)

    async def clean_validation_error(request, exc):
        path = request.url.path
        if original is not None and (path.startswith("/v1/messages") or path.endswith("/v1/systemone")):
            return await original(request, exc)  # sglang's own Anthropic / System One shapes
        message, field = validation_errors_message(exc.errors())
        if "json" not in request.headers.get("content-type", "").lower():
            message = message.rstrip(".") + " (send the body as JSON with Content-Type: application/json)."
        return ORJSONResponse(status_code=400, content=error_body(message, field))

    app.add_exception_handler(RequestValidationError, clean_validation_error)
    app.state.dlite_guards = True
    logger.info("DLITE request guards installed on %s", ", ".join(GUARDED_PATHS))
    return None


def _is_http_launcher() -> bool:
    """True in the process that runs sglang's HTTP server (``python -m sglang.launch_server`` or
    ``sglang serve``); False in scheduler / detokenizer subprocesses and in ``sgl.Engine`` users."""
    import multiprocessing
    import os
    import sys

    if multiprocessing.parent_process() is not None:
        return False
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name in ("sglang.launch_server", "sglang.cli.main") or argv0 in ("launch_server.py", "sglang")


def register_hooks() -> None:
    """Called by the plugin's ``register()``. The tokenizer-manager check runs wherever a
    TokenizerManager does (HTTP server and ``sgl.Engine``); the HTTP layer only in the launcher
    (importing sglang's http_server elsewhere would change the process's asyncio loop policy)."""
    import multiprocessing

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if multiprocessing.parent_process() is not None:
        return  # scheduler / detokenizer subprocesses have no tokenizer manager
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                          validate_tokenized, HookType.BEFORE)
    if _is_http_launcher():
        HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", install_http_guards,
                              HookType.BEFORE)
