"""The ASGI layer of the guards: a middleware that checks the guarded routes' bodies before FastAPI
sees them and answers a refusal (JSON, or one SSE error event for ``"stream": true``), and scrubs
every 4xx JSON body / SSE error event that the routes answer with."""

from __future__ import annotations

import json

from sglang_dlite.serving.metrics import record_refusal
from sglang_dlite.serving.guards.checks import (
    GUARDED_PATHS, RequestRefused, check_request, check_token_range, check_tools_parser, metric_field, parse_body,
)
from sglang_dlite.serving.guards.messages import error_body, sanitize_message


class RequestGuardMiddleware:
    """Pure ASGI: checks the guarded routes' JSON bodies before FastAPI sees them, and scrubs the
    messages of every 4xx JSON body / SSE error event they answer with."""

    def __init__(self, app, known_generate_fields=None, known_sampling_params=None, vocab_size=None,
                 tool_call_parser=None):
        self.app = app
        self.vocab_size = vocab_size  # callable -> the target's vocabulary size, or None
        self.tool_call_parser = tool_call_parser  # callable -> the server's tool-call parser, or None
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
                if self.tool_call_parser is not None:
                    check_tools_parser(scope["path"], body, self.tool_call_parser())
            except RequestRefused as exc:
                try:
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
