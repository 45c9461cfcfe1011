"""The sglang plugin: ``--speculative-algorithm DLITE``.

Declared in setup.py as the entry point ``sglang.srt.plugins: dlite =
sglang_dlite.serving:register``. sglang calls ``register()`` in the launcher
(``launch_server``, ``sglang serve``, ``sgl.Engine``) and in every scheduler subprocess. It:

1. checks the installed sglang against ``SUPPORTED_SGLANG`` (clear error outside it);
2. registers the drafter config with transformers (``AutoConfig.register("dlite", ...)``): sglang
   parses every draft-model path with ``AutoConfig``;
3. registers ``DLITE`` with ``SpeculativeAlgorithm.register`` (overlap scheduling supported);
4. hooks the target's CUDA-graph runner so TARGET_VERIFY graphs are captured with hidden-state
   capture for DLITE (``get_spec_info``); without it verify would run eagerly on CUDA;
5. hooks the scheduler's per-request validation so requests DLITE cannot serve
   (``return_hidden_states``) get a 400 with a message instead of a wrong answer;
6. in the HTTP server's process: the request guards (``guards/``) and the bundled target's
   tool-call parser ``smollm2`` (``tool_calls.py``);
7. the per-response speculation metrics (``spec_metrics.py``, ``spec_metrics_http.py``): the
   scheduler's output streamer, the tokenizer manager's meta_info, the OpenAI responses.

No sglang source is edited. The CPU-only test stand-ins (``cpu_support/sglang_cpu``) are never
loaded from here.
"""

from __future__ import annotations

import logging

from transformers import AutoConfig

from sglang_dlite.model.config import DLiteConfig
from sglang_dlite.serving.versions import SUPPORTED_SGLANG, check_sglang_version  # noqa: F401

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "DLITE"
_registered = False


def _worker_factory(server_args):
    from sglang_dlite.serving.worker import DLiteWorker  # optional: sglang (the worker imports it)

    return DLiteWorker


def _get_spec_info_hook(original, runner, *args, **kwargs):
    """AROUND hook on DecodeCudaGraphRunner.get_spec_info: sglang returns None for a plugin
    algorithm, so TARGET_VERIFY graphs would be captured without hidden-state output and
    ``can_run_graph`` would refuse DLITE's FULL-capture verify."""
    algo = getattr(runner.model_runner, "spec_algorithm", None)
    if getattr(algo, "name", None) == ALGORITHM_NAME and not getattr(runner.model_runner, "is_draft_worker", False):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode  # optional: sglang

        from sglang_dlite.serving.info import DLiteVerifyInput  # optional: sglang (info imports it)

        return DLiteVerifyInput(
            draft_token=None, positions=None, draft_token_num=runner.captured_req_width,
            custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL,
        )
    return original(runner, *args, **kwargs)


def _validate_request_hook(original, scheduler, req, *args, **kwargs):
    """AROUND hook on Scheduler.validate_dllm_request (the scheduler's per-request check whose
    message aborts the request with 400): DLITE refuses what it cannot serve
    (``verify_logits.request_error``)."""
    msg = original(scheduler, req, *args, **kwargs)
    algo = getattr(scheduler, "spec_algorithm", None)
    if msg is None and getattr(algo, "name", None) == ALGORITHM_NAME:
        from sglang_dlite.serving.spec_metrics import request_error as spec_metrics_error  # start-up cost: as below
        from sglang_dlite.serving.verify_logits import request_error  # start-up cost: keeps this entry point light (scheduler only)

        msg = request_error(req) or spec_metrics_error(req)
    return msg


def register() -> None:
    """sglang plugin entry point (idempotent)."""
    global _registered
    check_sglang_version()
    if _registered:
        return
    try:
        AutoConfig.register("dlite", DLiteConfig)
    except ValueError:  # already registered in this process
        pass

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # optional: sglang
    from sglang.srt.speculative.spec_registry import get_spec  # optional: sglang

    from sglang_dlite.serving.algorithm import DLiteSpecAlgo, validate_server_args  # optional: sglang (algorithm imports it)

    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM_NAME,
            supports_overlap=True,
            validate_server_args=validate_server_args,
            spec_class=DLiteSpecAlgo,
        )(_worker_factory)

    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

        HookRegistry.register(
            "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info",
            _get_spec_info_hook,
            HookType.AROUND,
        )
    except Exception as exc:  # pragma: no cover - only matters on CUDA
        logger.warning("DLITE: could not hook the CUDA-graph verify spec info (%s); verify runs eagerly.", exc)
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

        HookRegistry.register(
            "sglang.srt.managers.scheduler.Scheduler.validate_dllm_request",
            _validate_request_hook,
            HookType.AROUND,
        )
    except Exception as exc:  # pragma: no cover - sglang moved the per-request check
        logger.warning("DLITE: could not hook the scheduler's request validation (%s).", exc)
    try:  # request guards + client-readable errors (issue 18): launcher / tokenizer process only
        from sglang_dlite.serving.guards import register_hooks  # start-up cost: keeps this entry point light (register() only)

        register_hooks()
    except Exception as exc:  # pragma: no cover - sglang moved the tokenizer manager / http server
        logger.warning("DLITE: could not install the request guards (%s).", exc)
    try:  # per-response speculation metrics (issue 64 item 4): scheduler, tokenizer manager, OpenAI routes
        from sglang_dlite.serving.spec_metrics_http import register_hooks as register_spec_metrics  # start-up cost: register() only

        register_spec_metrics()
    except Exception as exc:  # pragma: no cover - sglang moved the output streamer / tokenizer manager
        logger.warning("DLITE: could not install the per-response speculation metrics (%s).", exc)
    try:  # the bundled target's tool-call parser: where sglang parses --tool-call-parser (launcher)
        from sglang_dlite.serving.guards.hooks import is_http_launcher  # start-up cost: keeps this entry point light (register() only)

        if is_http_launcher():
            from sglang_dlite.serving.tool_calls import register_parser  # optional: sglang (launcher only)

            register_parser()
    except Exception as exc:  # pragma: no cover - sglang moved its tool-call parsers
        logger.warning("DLITE: could not register the smollm2 tool-call parser (%s).", exc)
    _registered = True
