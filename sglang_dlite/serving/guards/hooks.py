"""How the guards are installed in sglang (plugin hooks, no sglang source edits): the tokenizer
manager's per-request check, and the HTTP layer (middleware + validation-error handler) in the
process that launches the HTTP server."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys

from sglang_dlite.serving.guards.asgi import RequestGuardMiddleware
from sglang_dlite.serving.guards.checks import GUARDED_PATHS, RequestRefused, is_int
from sglang_dlite.serving.guards.messages import error_body, validation_errors_message

logger = logging.getLogger(__name__)


def validate_tokenized(tm, obj, input_ids, *args, **kwargs):
    """BEFORE hook on ``TokenizerManager._validate_one_request(self, obj, input_ids)``."""
    from sglang.srt.managers.io_struct import GenerateReqInput  # optional: sglang

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
    if is_int(n) and n < 0:
        raise RequestRefused(f"`top_logprobs_num` must be at least 0, got {n}.", "top_logprobs_num")
    s = getattr(obj, "logprob_start_len", None)
    if is_int(s) and s < -1:
        raise RequestRefused(f"`logprob_start_len` must be -1 (output only) or at least 0, got {s}.", "logprob_start_len")
    return None


def known_fields():
    from sglang.srt.managers.io_struct import GenerateReqInput  # optional: sglang
    from sglang.srt.sampling.sampling_params import SamplingParams  # optional: sglang

    gen = {f.name for f in dataclasses.fields(GenerateReqInput)}
    sp = set(getattr(SamplingParams, "__struct_fields__", ()))
    # set by normalize(), never by a client
    sp -= {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"}
    return gen, (sp or None)


def install_http_guards(*args, **kwargs):
    """BEFORE hook on ``http_server.launch_server``: the middleware and the validation-error
    handler are added to sglang's FastAPI app before uvicorn starts it."""
    from fastapi.exceptions import RequestValidationError  # optional: fastapi (sglang's HTTP server)
    from fastapi.responses import ORJSONResponse  # optional: fastapi (sglang's HTTP server)

    from sglang.srt.entrypoints import http_server  # process boundary: sets the asyncio loop policy; launcher only

    app = http_server.app
    if getattr(app.state, "dlite_guards", False):
        return None
    gen, sp = known_fields()

    def tokenizer_manager():
        return getattr(getattr(http_server, "_global_state", None), "tokenizer_manager", None)

    def vocab_size():
        return getattr(getattr(tokenizer_manager(), "model_config", None), "vocab_size", None)

    def tool_call_parser():
        """The parser sglang uses (``auto`` resolved from the template); "unknown" before start-up."""
        tm = tokenizer_manager()
        return tm.config_value("tool_call_parser") if tm is not None else "unknown"

    app.add_middleware(RequestGuardMiddleware, known_generate_fields=gen, known_sampling_params=sp,
                       vocab_size=vocab_size, tool_call_parser=tool_call_parser)
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


def is_http_launcher() -> bool:
    """True in the process that runs sglang's HTTP server (``python -m sglang.launch_server`` or
    ``sglang serve``); False in scheduler / detokenizer subprocesses and in ``sgl.Engine`` users."""
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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

    if multiprocessing.parent_process() is not None:
        return  # scheduler / detokenizer subprocesses have no tokenizer manager
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                          validate_tokenized, HookType.BEFORE)
    if is_http_launcher():
        HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", install_http_guards,
                              HookType.BEFORE)
