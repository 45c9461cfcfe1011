"""The DLITE algorithm as sglang sees it: a ``CustomSpecAlgo`` subclass plus server-args hooks.

sglang 0.5.15-0.5.23 calls a few methods on every speculative algorithm that the default
``CustomSpecAlgo`` lacks (``carries_draft_hidden_states``, ``create_future_map``, ``need_topk``,
``get_platform_worker_cls``); ``DLiteSpecAlgo`` defines them, and the conformance test
(python_tests/serving/test_sglang_plugin.py) fails if sglang adds a public method to its
``SpeculativeAlgorithm`` enum that this class lacks.

Nothing here imports torch-heavy sglang modules at import time: ``register()`` runs in every
sglang process (launcher and schedulers).
"""

from __future__ import annotations

import os

from sglang.srt import runtime_context
from sglang.srt.speculative.spec_registry import CustomSpecAlgo
from transformers import AutoConfig

from sglang_dlite.model.config import supported_targets_text
from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.checkpoint import read_checkpoint_config
from sglang_dlite.model.dlite import load_checkpoint
from sglang_dlite.settings import ServingOptions


class DLiteSpecAlgo(CustomSpecAlgo):
    """History-free chain drafter: no draft model runner, no draft KV, hidden states relayed."""

    # --- what the scheduler / overlap relay ask every algorithm (missing on CustomSpecAlgo)
    def carries_draft_hidden_states(self) -> bool:
        # Only the PD-disaggregation transfer reads this (EAGLE-family draft hidden states).
        return False

    def need_topk(self) -> bool:
        return False

    def has_draft_kv(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap  # start-up cost: ~1 s, in every process register() runs in

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return None

    def supports_mixed_chunk(self) -> bool:
        return False

    def supports_grammar_overlap(self) -> bool:
        # The worker builds the grammar masks inside verify after calling the scheduler's grammar
        # barrier (verify_logits.grammar_mask), as DFlash does: grammar requests keep overlap.
        return True

    def handle_server_args(self, server_args) -> None:
        """num_draft_tokens W = ``default_num_draft_tokens`` unless the user asked for another
        (2 <= W <= ``max_verify_width``: fewer verifies a prefix of the chain); steps = W - 1,
        topk = 1."""
        k = draft_block_size(server_args.speculative_draft_model_path)
        w = server_args.speculative_num_draft_tokens
        w = default_num_draft_tokens(k, server_args) if w is None else int(w)
        server_args.speculative_num_steps = w - 1
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = w


def _read_draft_config(path):
    if not path:
        raise DLiteConfigError(
            "--speculative-algorithm DLITE needs --speculative-draft-model-path: a DLite "
            "checkpoint folder (config.json with model_type 'dlite' + model.safetensors)."
        )
    try:
        return read_checkpoint_config(path)
    except DLiteConfigError as exc:
        raise DLiteConfigError(f"--speculative-draft-model-path: {exc}") from None


# With the suffix lookup on, a round's chain may run past DLite's K drafts (the lookup continues
# it; copied text is accepted in long runs), so --speculative-num-draft-tokens may exceed K + 1, up
# to this many tokens per round (anchor included). DLite alone verifies at most K + 1.
HYBRID_MAX_DRAFT_TOKENS = 32


# The default on a CPU with hybrid drafting and a per-round verify width: the width policy
# verifies only what pays, so a longer cap costs nothing when the lookup has no long chain and lets
# a quoted run be accepted in fewer rounds (agent-stdlib, one thread: 1.85x -> 1.99x vs W = 8).
CPU_HYBRID_DRAFT_TOKENS = 16


def default_num_draft_tokens(block_size: int, server_args, options: "ServingOptions | None" = None) -> int:
    """W when --speculative-num-draft-tokens is unset: K + 1 (anchor + all of DLite's drafts;
    GPUs: one CUDA-graph shape), or ``CPU_HYBRID_DRAFT_TOKENS`` where hybrid drafting picks the
    verify width per round (a CPU; see drafting/budget.py). ``options`` None: resolved
    from the environment."""
    device = str(getattr(server_args, "device", None) or "")
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    options = options or ServingOptions.from_env()
    if (options.lookup and device.startswith("cpu")
            and options.adaptive_width(device, bool(getattr(server_args, "disable_cuda_graph", False)), tp)):
        return max(CPU_HYBRID_DRAFT_TOKENS, block_size + 1)
    return block_size + 1


def max_verify_width(block_size: int, lookup: bool) -> int:
    """Largest --speculative-num-draft-tokens for a drafter with K = ``block_size``."""
    return max(HYBRID_MAX_DRAFT_TOKENS, block_size + 1) if lookup else block_size + 1


def draft_block_size(path) -> int:
    raw = _read_draft_config(path)
    return int(raw.get("block_size", 7))


def _target_dims(model_path: str):
    """(hidden_size, vocab_size, num_layers, model_type) of the target from its config.json."""
    cfg = AutoConfig.from_pretrained(model_path)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    return text.hidden_size, text.vocab_size, text.num_hidden_layers, getattr(text, "model_type", None)


def validate_server_args(server_args) -> None:
    """Start-up checks, in the launcher, before any scheduler process starts.

    A missing / corrupt checkpoint, a drafter built for another target, K inconsistent with
    --speculative-num-draft-tokens / --speculative-num-steps / --speculative-eagle-topk all fail
    here with a message that says what to change.
    """
    path = server_args.speculative_draft_model_path
    _read_draft_config(path)
    config, _state = load_checkpoint(path)  # validates config + safetensors (clear errors)
    k = config.block_size
    ndt = server_args.speculative_num_draft_tokens
    options = ServingOptions.from_env()  # a bad SGLANG_DLITE_CONFIG stops the launch here
    lookup = options.lookup
    w_max = max_verify_width(k, lookup)
    if ndt is not None and not 2 <= int(ndt) <= w_max:
        note = " and the suffix lookup may continue a chain past them" if lookup else ""
        hint = ("" if lookup else " With the suffix lookup on (the setting lookup: true) a chain may run up to "
                f"{max_verify_width(k, True)} tokens.")
        raise DLiteConfigError(
            f"--speculative-num-draft-tokens {ndt} does not fit this DLite drafter: it drafts K={k} tokens "
            f"per round{note}, so a round verifies at most {w_max} tokens (anchor + drafts). Pass "
            f"--speculative-num-draft-tokens between 2 and {w_max} (fewer verifies a prefix of the chain), "
            f"or leave it unset ({default_num_draft_tokens(k, server_args, options)}).{hint}"
        )
    w = default_num_draft_tokens(k, server_args, options) if ndt is None else int(ndt)
    steps = server_args.speculative_num_steps
    if steps is not None and int(steps) != w - 1:
        raise DLiteConfigError(
            f"--speculative-num-steps {steps} does not fit this DLite drafter (K={k}, "
            f"{w} draft tokens verified per round); pass {w - 1} or leave it unset."
        )
    topk = server_args.speculative_eagle_topk
    if topk is not None and int(topk) != 1:
        raise DLiteConfigError(
            f"--speculative-eagle-topk {topk}: DLITE drafts a chain (top-k 1); leave it unset."
        )
    model_path = server_args.model_path
    if model_path and os.path.isdir(model_path):
        hidden, vocab, layers, mtype = _target_dims(model_path)
        config.check_target(hidden_size=hidden, vocab_size=vocab, num_layers=layers)
        check_capture_layers(config.target_layer_ids, layers)
        check_attention_only_target(model_path)
    check_deployment(server_args)
    cpu_schedule(server_args, options)


def cpu_schedule(server_args, options: ServingOptions) -> None:
    """On a CPU device, sglang's non-overlap scheduler (what sglang picks for its own speculative
    algorithms there, ``_disable_overlap_schedule_for_cpu``), unless the setting ``cpu_overlap``.
    A CPU forward returns only when it has run, so the overlap loop overlaps nothing: it processes
    each result after the next round has run, which holds a prefill's first token for one round
    (draft + verify), and it schedules that round before the result that finishes a request is seen,
    so every finished request costs one wasted round before the next prefill (float32, turn 2 right
    after a 128-token turn 1: time to first token 0.955 s -> 0.649 s; no speculation 0.699 s)."""
    if str(getattr(server_args, "device", "")) == "cpu" and not options.cpu_overlap \
            and not getattr(server_args, "disable_overlap_schedule", True):
        server_args.disable_overlap_schedule = True


def check_capture_layers(layer_ids, num_layers: int) -> None:
    """sglang captures the *output* of a decoder layer for the drafter, and never the last one
    (its output is the final hidden state, which the capture hooks do not see)."""
    bad = [i for i in layer_ids if not 0 <= int(i) <= num_layers - 2]
    if bad:
        raise DLiteConfigError(
            f"this DLite drafter reads target layers {list(layer_ids)}, but sglang can capture only "
            f"layers 0..{num_layers - 2} of this {num_layers}-layer target (layer ids {bad} are out of "
            "range; the last layer's output is never captured). Use a drafter trained with "
            f"--target-layer-ids inside 0..{num_layers - 2} (the default recipe's are)."
        )


# Targets whose decoder keeps a recurrent (Mamba / linear-attention) state besides the KV cache:
# DLITE's chain verify advances that state over rejected drafts and never rolls it back.
_HYBRID_MODEL_TYPES = {
    "mamba", "mamba2", "jamba", "zamba", "zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid",
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "minimax", "minimax_m1", "kimi_linear",
    "bamba", "plamo2", "hunyuan_v1_dense_hybrid", "olmo3_2_hybrid", "recurrent_gemma",
}
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "global", "local", "chunked_attention"}


def hybrid_reason(text_config) -> "str | None":
    """Why this (HF text) config is a hybrid recurrent/attention target, or None."""
    mtype = str(getattr(text_config, "model_type", "") or "").lower()
    if mtype in _HYBRID_MODEL_TYPES or "mamba" in mtype:
        return f"model_type {mtype!r}"
    types = getattr(text_config, "layer_types", None) or getattr(text_config, "layers_block_type", None)
    if isinstance(types, (list, tuple)):
        other = sorted({str(t) for t in types} - _ATTENTION_LAYER_TYPES)
        if other:
            return f"layer types {other}"
    return None


def check_attention_only_target(model_path: str) -> None:
    cfg = AutoConfig.from_pretrained(model_path)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    reason = hybrid_reason(text)
    if reason is not None:
        raise DLiteConfigError(
            f"DLITE does not support targets with Mamba / linear-attention state ({model_path!r}: {reason}): "
            "its chain verify would leave that state advanced over rejected drafts. Serve this model "
            "without --speculative-algorithm, or with --speculative-algorithm EAGLE / DFLASH / NGRAM, "
            "which commit the recurrent state after verify."
        )


# Attention backends DLITE's verify is known to be right on. The verify is a TARGET_VERIFY forward
# over [anchor, d_1..d_n] per request with no custom mask (``DLiteVerifyInput``: DFlash's linear
# verify input, ``custom_mask=None``, also in the CUDA graphs the plugin's spec-info hook captures),
# so the backend's own causal extend attention must be the chain mask. GPU: the backends sglang's
# own DFLASH runs this same verify input on without a custom mask
# (``dflash_utils._DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS``) that this project's docs name; CPU:
# torch_native, with this project's TARGET_VERIFY hook (cpu_support/, `sglang-dlite serve --cpu`),
# the backend every CPU test of DLITE runs on. Any other backend (intel_amx reads ``tree_topk``, which
# the verify input lacks; trtllm_mha / fa4 / aiter / ... were never run with it) is refused.
VERIFY_ATTENTION_BACKENDS = {
    "flashinfer": "GPU",
    "fa3": "GPU",
    "triton": "GPU",
    "torch_native": "CPU, with this project's verify hook: `sglang-dlite serve --cpu`",
}


def verify_attention_backend(server_args):
    """(backend, the flag that set it) that runs DLITE's TARGET_VERIFY: (name, None) for sglang's
    resolved choice in a scheduler process (its auto-picked default included), (None, None) while
    sglang still has to pick its default (the launcher; the worker's check sees it then). As
    sglang's HybridAttnBackend: the prefill backend, or the decode one under
    --speculative-attention-mode decode; a split field falls back to --attention-backend."""
    mode = getattr(server_args, "speculative_attention_mode", None) or "prefill"
    split, flag = (("decode_attention_backend", "--decode-attention-backend") if mode == "decode"
                   else ("prefill_attention_backend", "--prefill-attention-backend"))
    name = getattr(server_args, split, None)
    if name:
        return str(name), flag
    name = getattr(server_args, "attention_backend", None)
    if name:
        return str(name), "--attention-backend"
    try:  # a scheduler process: sglang's resolved pair (its auto-picked default included)
        prefill, decode = runtime_context.attention_backends()
    except Exception:  # the launcher, before sglang publishes its config
        return None, None
    name = decode if mode == "decode" else prefill
    return (str(name), None) if name else (None, None)


def check_attention_backend(server_args) -> None:
    name, flag = verify_attention_backend(server_args)
    if name is None or name in VERIFY_ATTENTION_BACKENDS:
        return
    known = "; ".join(f"{n} ({where})" for n, where in VERIFY_ATTENTION_BACKENDS.items())
    picked = "sglang's resolved choice" if flag is None else f"{flag} {name}"
    raise DLiteConfigError(
        f"DLITE's verify has not been verified with the {name!r} attention backend ({picked}): it runs "
        "TARGET_VERIFY over [anchor, drafts] with no custom mask, which needs the backend's own causal "
        f"attention to be the chain mask. Verified backends: {known}. Pick one with --attention-backend "
        "NAME, e.g. --attention-backend flashinfer (or fa3 / triton) on a GPU, --attention-backend "
        "torch_native on a CPU, or serve without --speculative-algorithm DLITE."
    )


def check_deployment(server_args) -> None:
    """Deployment modes the DLITE worker does not implement: refused at launch."""
    pp = getattr(server_args, "pp_size", 1)
    if pp not in (None, 1):
        raise DLiteConfigError(
            f"DLITE does not support pipeline parallelism (--pp-size {pp}): its worker runs the whole "
            "target in one stage. Use --pp-size 1 (scale out with more replicas, --dp-size), or serve "
            "without --speculative-algorithm DLITE."
        )
    # Tensor parallelism (--tp-size, --nnodes) and plain data parallelism (--dp-size replicas) are
    # supported; attention data / context parallelism shards the batch or the sequence across the
    # ranks of one TP group, so the ranks would no longer draft for the same requests.
    for flag, field in (("--attn-dp-size", "attn_dp_size"), ("--attn-cp-size", "attn_cp_size")):
        n = getattr(server_args, field, 1)
        if n not in (None, 1) and int(n) > 1:
            raise DLiteConfigError(
                f"DLITE does not support attention data/context parallelism ({flag} {n}): its worker "
                "expects every TP rank to hold the whole batch and full-width hidden states. Use plain "
                "--tp-size N (tensor parallel) and/or --dp-size M (independent replicas, each with its "
                "own DLITE drafter), or serve without --speculative-algorithm DLITE."
            )
    if getattr(server_args, "enable_dp_attention", False):
        raise DLiteConfigError(
            "DLITE does not support DP attention (--enable-dp-attention): its worker expects every TP "
            "rank to hold the whole batch. Use plain --tp-size N and/or --dp-size M (independent "
            "replicas), or serve without --speculative-algorithm DLITE."
        )
    mode = getattr(server_args, "disaggregation_mode", "null")
    if mode not in (None, "null"):
        raise DLiteConfigError(
            f"DLITE does not support prefill/decode disaggregation (--disaggregation-mode {mode}): "
            "the DLITE drafter state (context hidden states) is not transferred from the prefill "
            "server. Serve without --disaggregation-mode (one server does both), or use "
            "--speculative-algorithm EAGLE / EAGLE3 for disaggregated serving."
        )
    check_attention_backend(server_args)


def check_target_supported(model_runner, cfg, server_args) -> None:
    """Launch-time refusals the launcher's validate_server_args may not see (Engine args built
    in-process, a model config only sglang resolves): capture layers, recurrent-state targets,
    pipeline parallel / PD disaggregation."""
    try:  # sglang's own Mamba-pool test; a heavy sglang import, so only when a worker starts
        from sglang.srt.configs.hybrid_arch import mambaish_config
    except ImportError:  # pragma: no cover  (sglang releases without it: hybrid_reason stands alone)
        mambaish_config = None
    hf = model_runner.model_config.hf_text_config
    check_capture_layers(cfg.target_layer_ids, hf.num_hidden_layers)
    check_deployment(server_args)
    reason = hybrid_reason(hf)
    if reason is None and mambaish_config is not None and mambaish_config(model_runner.model_config) is not None:
        reason = "sglang runs it with a Mamba / linear-attention state pool"
    if reason is not None:
        raise DLiteConfigError(
            f"DLITE does not support targets with Mamba / linear-attention state ({reason}): its chain "
            "verify would leave that state advanced over rejected drafts. Serve this model without "
            "--speculative-algorithm, or with EAGLE / DFLASH / NGRAM, which commit the state after verify."
        )


def capture_target_layers(model, layer_ids) -> None:
    """Make the target's sglang model capture these decoder-layer outputs for the drafter. Both
    setters, given explicit layer ids, capture the same outputs (sglang's Qwen2 model has only the
    EAGLE-3 one). Must run before the target's CUDA graphs are captured (init_cuda_graphs comes later)."""
    set_capture = (getattr(model, "set_dflash_layers_to_capture", None)
                   or getattr(model, "set_eagle3_layers_to_capture", None))
    if set_capture is None:
        raise DLiteConfigError(
            f"DLITE needs a target whose sglang model can capture decoder-layer outputs "
            f"(set_dflash_layers_to_capture / set_eagle3_layers_to_capture); {type(model).__name__} "
            f"cannot. Supported targets: {supported_targets_text()}."
        )
    set_capture(list(layer_ids))
