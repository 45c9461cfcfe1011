"""The DLITE algorithm as sglang sees it: a ``CustomSpecAlgo`` subclass plus server-args hooks.

sglang 0.5.15-0.5.23 calls a few methods on every speculative algorithm that the default
``CustomSpecAlgo`` lacks (``carries_draft_hidden_states``, ``create_future_map``, ``need_topk``,
``get_platform_worker_cls``); ``DLiteSpecAlgo`` defines them, and the conformance test
(python_tests/test_sglang_plugin.py) fails if sglang adds a public method to its
``SpeculativeAlgorithm`` enum that this class lacks.

Nothing here imports torch-heavy sglang modules at import time: ``register()`` runs in every
sglang process (launcher and schedulers).
"""

from __future__ import annotations

import json
import os

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

ALGORITHM_NAME = "DLITE"


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
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return None

    def supports_mixed_chunk(self) -> bool:
        return False

    def supports_grammar_overlap(self) -> bool:
        return False

    def handle_server_args(self, server_args) -> None:
        """num_draft_tokens W = K + 1 (anchor + all K drafts, from the checkpoint) unless the user
        asked for fewer (2 <= W <= K + 1: verify the first W - 1 drafts of the chain); steps =
        W - 1, topk = 1."""
        k = draft_block_size(server_args.speculative_draft_model_path)
        w = server_args.speculative_num_draft_tokens
        w = k + 1 if w is None else int(w)
        server_args.speculative_num_steps = w - 1
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = w


def _read_draft_config(path):
    from ..errors import DLiteConfigError

    if not path:
        raise DLiteConfigError(
            "--speculative-algorithm DLITE needs --speculative-draft-model-path: a DLite "
            "checkpoint folder (config.json with model_type 'dlite' + model.safetensors)."
        )
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise DLiteConfigError(
            f"--speculative-draft-model-path {path!r} is not a DLite checkpoint folder (no config.json)."
        )
    try:
        with open(cfg_file) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise DLiteConfigError(f"{cfg_file!r} is not valid JSON ({exc}).") from exc


def draft_block_size(path) -> int:
    raw = _read_draft_config(path)
    return int(raw.get("block_size", 7))


def _target_dims(model_path: str):
    """(hidden_size, vocab_size, num_layers, model_type) of the target from its config.json."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    return text.hidden_size, text.vocab_size, text.num_hidden_layers, getattr(text, "model_type", None)


def validate_server_args(server_args) -> None:
    """Start-up checks, in the launcher, before any scheduler process starts.

    A missing / corrupt checkpoint, a drafter built for another target, K inconsistent with
    --speculative-num-draft-tokens / --speculative-num-steps / --speculative-eagle-topk all fail
    here with a message that says what to change.
    """
    from ..errors import DLiteConfigError
    from ..model import load_checkpoint

    path = server_args.speculative_draft_model_path
    _read_draft_config(path)
    config, _state = load_checkpoint(path)  # validates config + safetensors (clear errors)
    k = config.block_size
    ndt = server_args.speculative_num_draft_tokens
    if ndt is not None and not 2 <= int(ndt) <= k + 1:
        raise DLiteConfigError(
            f"--speculative-num-draft-tokens {ndt} does not fit this DLite drafter: it drafts "
            f"K={k} tokens per round, so a round verifies at most K+1={k + 1} tokens (anchor + drafts). "
            f"Pass --speculative-num-draft-tokens between 2 and {k + 1} (fewer verifies a prefix of "
            f"the drafts), or leave it unset ({k + 1})."
        )
    w = k + 1 if ndt is None else int(ndt)
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
    if getattr(server_args, "tp_size", 1) not in (None, 1):
        raise DLiteConfigError("DLITE supports --tp-size 1 only in this release.")
