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
   unknown fields of ``/generate``, a ``json_schema`` that is not JSON; ``tools`` under
   ``tool_choice`` "auto" on a server with no ``--tool-call-parser``, which would never answer
   with ``tool_calls``). Run by
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

Modules: ``checks`` (layer 1, pure), ``messages`` (layer 3's text), ``asgi`` (the middleware),
``hooks`` (layer 2 and the installation in sglang).
"""

from __future__ import annotations

from sglang_dlite.serving.guards.asgi import RequestGuardMiddleware  # noqa: F401
from sglang_dlite.serving.guards.checks import (  # noqa: F401
    GUARDED_PATHS, RequestRefused, check_request, check_sampling_params, check_token_range, metric_field, parse_body,
)
from sglang_dlite.serving.guards.hooks import install_http_guards, known_fields, register_hooks, validate_tokenized  # noqa: F401
from sglang_dlite.serving.guards.messages import MAX_MESSAGE_CHARS, error_body, sanitize_message, validation_errors_message  # noqa: F401
