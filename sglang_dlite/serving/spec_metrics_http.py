"""The per-response speculation metrics (``spec_metrics.py``) in sglang's OpenAI responses, and the
hooks that carry them there (plugin hooks, no sglang source edits).

- non-streamed (``_build_chat_response`` / ``_build_completion_response``, AFTER): the response model
  gains a top-level ``metrics`` field, ``{"speculative_decoding": ...}`` summed over its choices;
- streamed (``_generate_chat_stream`` / ``_generate_completion_stream``, AROUND, for requests that may
  get metrics): the chunks pass as they are until the request's last output came back; from then the
  newest chunk is held until the next one, and the one before ``data: [DONE]`` (the usage chunk with
  ``stream_options.include_usage``, else the finish chunk) gets ``"metrics"`` appended; the summaries
  come from the generator's outputs (AROUND hook on ``TokenizerManager.generate_request``, which
  notes the ``meta_info`` summaries of a request that carries a box).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
from typing import Any, Dict, Optional

from sglang_dlite.serving.spec_metrics import META_KEY, REQUEST_KEY, meta_info_hook, merge, mode_of, \
    streamer_class_hook
from sglang_dlite.settings import ServingOptions

logger = logging.getLogger(__name__)

_BOX = "_dlite_spec_box"  # attribute of a streamed request's GenerateReqInput: {choice index: summary}
_DONE = "data: [DONE]"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_OPENAI = {  # the serving class: (response builder, stream generator)
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat": ("_build_chat_response", "_generate_chat_stream"),
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion": (
        "_build_completion_response", "_generate_completion_stream"),
}


@functools.lru_cache(maxsize=1)
def server_mode() -> str:
    """The setting ``spec_metrics`` of this server (off where the settings do not parse: the launch
    checks say why on a DLITE server)."""
    try:
        return ServingOptions.from_env().spec_metrics
    except Exception:
        return "off"


def may_want(request) -> bool:
    """Whether an OpenAI request may get metrics (its opt-in, or the server's setting)."""
    params = getattr(request, "custom_params", None)
    return mode_of(params.get(REQUEST_KEY) if isinstance(params, dict) else None, server_mode()) != "off"


def metrics_of(outputs) -> Optional[dict]:
    """The ``metrics`` object of a response from its outputs (``meta_info`` each), None without one."""
    parts = [(o.get("meta_info") or {}).get(META_KEY) for o in outputs if isinstance(o, dict)]
    merged = merge([p for p in parts if p])
    return None if merged is None else {"speculative_decoding": merged}


# ---------------------------------------------------------------------------- non-streamed
@functools.lru_cache(maxsize=None)
def _with_metrics_model(cls):
    from pydantic import create_model  # optional: pydantic (sglang's OpenAI protocol)

    return create_model(cls.__name__, __base__=cls, metrics=(Optional[Dict[str, Any]], None))


def with_metrics(response, metrics: dict):
    """``response`` (an OpenAI response model) with a top-level ``metrics`` field; other values as they are."""
    cls = type(response)
    if not hasattr(cls, "model_fields"):
        return response
    fields = {name: getattr(response, name) for name in cls.model_fields}
    return _with_metrics_model(cls).model_construct(_fields_set=set(response.model_fields_set) | {"metrics"},
                                                    metrics=metrics, **fields)


def response_hook(result, serving, request, ret, *args, **kwargs):
    """AFTER hook on the OpenAI response builders (``(self, request, ret, created)``)."""
    metrics = metrics_of(ret if isinstance(ret, list) else [ret])
    return None if metrics is None else with_metrics(result, metrics)


# ---------------------------------------------------------------------------- streamed
def generate_request_hook(original, tm, obj, *args, **kwargs):
    """AROUND hook on ``TokenizerManager.generate_request``: a request with a box notes its summaries."""
    gen = original(tm, obj, *args, **kwargs)
    box = getattr(obj, _BOX, None)
    return gen if box is None else _noting(gen, box)


async def _noting(gen, box: dict):
    try:
        async for out in gen:
            for o in out if isinstance(out, list) else [out]:
                summary = (o.get("meta_info") or {}).get(META_KEY) if isinstance(o, dict) else None
                if summary:
                    box[o.get("index", 0)] = summary
            yield out
    finally:
        await gen.aclose()


def stream_hook(original, serving, adapted_request, request, *args, **kwargs):
    """AROUND hook on the OpenAI stream generators (``(self, adapted_request, request, raw_request)``)."""
    if not may_want(request):
        return original(serving, adapted_request, request, *args, **kwargs)
    box: dict = {}
    setattr(adapted_request, _BOX, box)
    return _with_final_metrics(original(serving, adapted_request, request, *args, **kwargs), box)


def inject(chunk: str, metrics: dict) -> Optional[str]:
    """An SSE chunk ``data: {...}`` with ``"metrics"`` appended to its object; None for another kind
    (an error event, a named event)."""
    if not (chunk.startswith('data: {"id"') and chunk.endswith("}\n\n")):
        return None
    return chunk[:-3] + ',"metrics":' + json.dumps(metrics, separators=(",", ":")) + "}\n\n"


def _metrics_chunk(template: Optional[str], metrics: dict) -> Optional[str]:
    """A chunk of its own (no choices) for the metrics, shaped as ``template`` (an earlier chunk)."""
    if template is None:
        return None
    head = json.loads(template[len("data: "):])
    body = {k: head[k] for k in ("id", "object", "created", "model") if k in head}
    return "data: " + json.dumps({**body, "choices": [], "metrics": metrics}, separators=(",", ":")) + "\n\n"


def closing_chunks(held: Optional[str], template: Optional[str], box: dict) -> list:
    """What goes before ``data: [DONE]``: the held last chunk with the metrics (or, where it cannot
    carry them, itself and a metrics chunk after it); an error event as it is."""
    if not box:
        return [] if held is None else [held]
    metrics = metrics_of([{"meta_info": {META_KEY: box[i]}} for i in sorted(box)])
    if held is not None and held.startswith('data: {"error"'):
        return [held]  # an error ends the stream: no metrics
    done = None if held is None else inject(held, metrics)
    if done is not None:
        return [done]
    return [c for c in (held, _metrics_chunk(template, metrics)) if c is not None]


async def _with_final_metrics(gen, box: dict):
    held = template = None
    try:
        async for chunk in gen:
            if not isinstance(chunk, str):
                yield chunk
                continue
            if chunk.startswith('data: {"id"'):
                template = chunk
            if chunk.startswith(_DONE):
                for c in closing_chunks(held, template, box):
                    yield c
                held = None
                yield chunk
            elif box:  # the request's last output came back: this chunk may be the last one
                if held is not None:
                    yield held
                held = chunk
            else:
                yield chunk
        if held is not None:
            yield held
    finally:
        await gen.aclose()


# ---------------------------------------------------------------------------- installation
def register_hooks() -> None:
    """Called by the plugin's ``register()``: the scheduler's streamer everywhere (it applies to a DLITE
    scheduler only), the tokenizer manager's hooks where one runs, the OpenAI ones in the HTTP server."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

    from sglang_dlite.serving.guards.hooks import is_http_launcher  # start-up cost: register() only

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class",
                          streamer_class_hook, HookType.AROUND)
    if multiprocessing.parent_process() is not None:
        return  # scheduler / detokenizer subprocesses have no tokenizer manager
    HookRegistry.register(_TM + ".update_request_meta_info", meta_info_hook, HookType.AROUND)
    HookRegistry.register(_TM + ".generate_request", generate_request_hook, HookType.AROUND)
    if is_http_launcher():
        for cls, (build, stream) in _OPENAI.items():
            HookRegistry.register(f"{cls}.{build}", response_hook, HookType.AFTER)
            HookRegistry.register(f"{cls}.{stream}", stream_hook, HookType.AROUND)
