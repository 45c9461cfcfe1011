"""The DLITE spec-v2 worker: the target forward, the DLite drafter, chain verify, accept.

There is no draft model runner, no draft KV pool and no draft attention backend. Per request the
drafter's state is the bonus token and the target's hidden states of the last C committed
positions (``info.DLiteDraftInput``), carried through ``filter_batch`` / ``merge_batch`` and the
overlap relay. Invariant between rounds (the same as the reference engine's,
``sglang_dlite/engine.py``): the target KV covers ``seq_lens`` tokens; the anchor (bonus token) is
the next one and is not yet in the KV; the context hidden states are those of positions
``seq_lens - C .. seq_lens - 1``.

Round (decode batch):
  1. draft  : K tokens per request from (context hidden states, anchor) -- one drafter pass;
              with hybrid drafting (the default) the suffix lookup's chain, DLite's, or DLite's
              prefix continued by the lookup (up to W - 1 tokens, W may exceed K + 1), and on a
              CPU a per-round width (``_draft_hybrid``).
  2. verify : one TARGET_VERIFY forward over [anchor, d_1..d_n] (n + 1 <= W tokens per request),
              written to the W KV slots the scheduler reserved (``eagle_prepare_for_decode``),
              capturing the drafter's target layers (FULL capture).
  3. accept : every sglang logits adjustment on all W rows (penalties with the drafts counted,
              grammar mask, logit_bias, custom processors: ``verify_logits.py``), then the longest
              prefix of drafts equal to the target's per-row choice (argmax, or sglang's sampler:
              top-k/top-p/min-p, per-request seeds); the bonus token comes from the target.
  4. carry  : new context = last C rows of [old context, verify rows 0..a] (anchor + accepted).
Rejected slots need no cleanup: the next round overwrites them (chain, no KV moves).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from .. import ops
from ..errors import DLiteConfigError
from ..lookup.batch import ENV_LOOKUP, ENV_TRACE, BatchLookup, lookup_enabled
from ..model import DLiteDrafter
from ..speculation.context import last_rows_of_segments
from ..speculation.verify_width import VerifyWidthPolicy, adaptive_width_wanted
from .algorithm import max_verify_width
from . import metrics as dlite_metrics
from . import verify_logits
from .cuda_graphs import DrafterCudaGraphs
from .info import DLiteDraftInput, DLiteVerifyInput
from .tensor_parallel import check_gathered_embedding, gather_vocab_rows, same_on_all_ranks, tp_group

logger = logging.getLogger(__name__)


def _target_parts(model):
    """(embedding weight, LM head weight, hf text config) of an sglang causal LM."""
    inner = getattr(model, "model", model)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None or not hasattr(embed, "weight"):
        raise DLiteConfigError(f"DLITE: {type(model).__name__} exposes no model.embed_tokens.weight.")
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise DLiteConfigError(f"DLITE: {type(model).__name__} exposes no lm_head.weight.")
    return embed.weight, lm_head.weight


ENV_DRAFTER_DTYPE = "SGLANG_DLITE_DRAFTER_DTYPE"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def drafter_dtype(target_dtype: torch.dtype, device) -> torch.dtype:
    """The drafter's dtype: ``SGLANG_DLITE_DRAFTER_DTYPE`` (float32 | bfloat16 | float16 | target).
    By default the target's, except on a CPU without bf16 arithmetic (no avx512_bf16 / AMX), where
    it is float32: there the drafter's few-row fp32 GEMVs beat emulated bf16 ones (draft round
    1.2-2.6x faster; the drafter reads the target's hidden states in its own dtype, and its drafts,
    not the output, depend on it: verify is lossless)."""
    name = os.environ.get(ENV_DRAFTER_DTYPE, "").strip().lower()
    if not name:
        cpu = str(device).startswith("cpu")
        name = "float32" if cpu and target_dtype != torch.float32 and not ops.cpu_has_native_bf16() else "target"
    if name == "target":
        return target_dtype
    if name not in _DTYPES:
        raise DLiteConfigError(f"{ENV_DRAFTER_DTYPE}={name!r} is not understood; use one of "
                               f"{', '.join(list(_DTYPES) + ['target'])}.")
    return _DTYPES[name]


def _check_target_supported(model_runner, cfg, server_args) -> None:
    """Launch-time refusals the launcher's validate_server_args may not see (Engine args built
    in-process, a model config only sglang resolves): capture layers, recurrent-state targets,
    pipeline parallel / PD disaggregation."""
    from .algorithm import check_capture_layers, check_deployment, hybrid_reason

    hf = model_runner.model_config.hf_text_config
    check_capture_layers(cfg.target_layer_ids, hf.num_hidden_layers)
    check_deployment(server_args)
    reason = hybrid_reason(hf)
    if reason is None:
        try:
            from sglang.srt.configs.hybrid_arch import mambaish_config

            if mambaish_config(model_runner.model_config) is not None:
                reason = "sglang runs it with a Mamba / linear-attention state pool"
        except ImportError:  # pragma: no cover - moved in another sglang release
            pass
    if reason is not None:
        raise DLiteConfigError(
            f"DLITE does not support targets with Mamba / linear-attention state ({reason}): its chain "
            "verify would leave that state advanced over rejected drafts. Serve this model without "
            "--speculative-algorithm, or with EAGLE / DFLASH / NGRAM, which commit the state after verify."
        )


class DLiteWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        spec = get_spec()
        path = spec.speculative_draft_model_path

        model = self.model_runner.model
        hf = self.model_runner.model_config.hf_text_config
        dtype = drafter_dtype(self.model_runner.dtype, self.device)
        drafter = DLiteDrafter.from_pretrained(path, dtype=dtype, device=self.device)
        logger.info("DLITE drafter dtype %s (target %s; %s)", dtype, self.model_runner.dtype, ENV_DRAFTER_DTYPE)
        cfg = drafter.config
        cfg.check_target(hidden_size=hf.hidden_size, vocab_size=hf.vocab_size,
                         num_layers=hf.num_hidden_layers)
        _check_target_supported(self.model_runner, cfg, server_args)
        if cfg.history_window != 0:
            raise DLiteConfigError(
                f"DLITE serves history-free drafters only; {path!r} has history={cfg.history!r} "
                "(a teacher / sliding-window ablation checkpoint)."
            )
        embed_w, head_w = _target_parts(model)
        # sglang pads the vocabulary rows (to a multiple of 64 per TP rank): bind the real ones.
        # Under tensor parallelism both are vocabulary-sharded: every rank gathers a full copy once
        # (padding stripped), so drafting needs no collective; the copy is that rank's extra memory.
        V = cfg.vocab_size
        self._tp = tp_group(self.model_runner)
        self.tp_rank = 0 if self._tp is None else int(self._tp.rank_in_group)
        embed_full = gather_vocab_rows(embed_w, V, self._tp)
        head_full = embed_full if head_w is embed_w else gather_vocab_rows(head_w, V, self._tp)
        if self._tp is not None:
            check_gathered_embedding(getattr(model, "model", model).embed_tokens, embed_full)
        drafter.bind_target(embed_full, head_full)
        self._tp_sync = self._tp is not None and os.environ.get("SGLANG_DLITE_TP_SYNC", "1") != "0"
        self._tp_check = self._tp is not None and os.environ.get("SGLANG_DLITE_TP_CHECK", "0") == "1"
        mib = 2 ** 20
        own = sum(t.numel() * t.element_size() for t in list(drafter.parameters()) + list(drafter.buffers())
                  if t.data_ptr() not in {w.data_ptr() for w in (embed_w, head_w, embed_full, head_full)})
        copies = 0 if self._tp is None else embed_full.numel() * embed_full.element_size() * (
            1 if head_full is embed_full else 2)
        self.drafter_memory = {"tp_rank": self.tp_rank, "drafter_weights_mib": round(own / mib, 1),
                               "gathered_vocab_copies_mib": round(copies / mib, 1)}
        logger.info("DLITE drafter memory on TP rank %d: %.1f MiB weights (replicated) + %.1f MiB gathered "
                    "target embedding/LM head", self.tp_rank, own / mib, copies / mib)
        if str(self.device).startswith("cpu") and ops.ops_mode() != "torch":  # bf16 GEMMs on prepacked weights
            ops.pack_cpu_linears(drafter)
        self.drafter = drafter
        self.drafter_block_size = cfg.block_size  # K: drafts the drafter can make per round
        # Tokens verified per round, at most (anchor + the first W-1 drafts of the chain):
        # --speculative-num-draft-tokens or spec.default_num_draft_tokens. With the lookup on, a
        # chain may run past DLite's K drafts (the lookup continues it), up to max_verify_width.
        self.W = int(spec.speculative_num_draft_tokens)
        self.num_drafts = self.W - 1  # chain length verified per round (at most)
        self.dlite_drafts = min(self.num_drafts, self.drafter_block_size)  # drafts DLite makes per pass
        self.C = cfg.num_context_positions
        self.L = cfg.num_capture_layers
        self.H = cfg.target_hidden_size
        self.state_width = self.L * self.H + 1
        w_max = max_verify_width(self.drafter_block_size, lookup_enabled())
        if not 2 <= self.W <= w_max:
            raise DLiteConfigError(
                f"DLITE: speculative_num_draft_tokens={self.W} but the drafter has K={self.drafter_block_size} "
                f"(needs 2..{w_max}{'' if lookup_enabled() else f' with {ENV_LOOKUP}=0'})."
            )
        # Both setters, given explicit layer ids, capture the same decoder-layer outputs (sglang's
        # Qwen2 model has only the EAGLE-3 one).
        set_capture = (getattr(model, "set_dflash_layers_to_capture", None)
                       or getattr(model, "set_eagle3_layers_to_capture", None))
        if set_capture is None:
            from ..config import supported_targets_text

            raise DLiteConfigError(
                f"DLITE needs a target whose sglang model can capture decoder-layer outputs "
                f"(set_dflash_layers_to_capture / set_eagle3_layers_to_capture); {type(model).__name__} "
                f"cannot. Supported targets: {supported_targets_text()}."
            )
        # Must run before the target's CUDA graphs are captured (init_cuda_graphs comes later).
        set_capture(list(cfg.target_layer_ids))
        self._graphs: Optional[DrafterCudaGraphs] = None
        self._metrics = dlite_metrics.worker_timer(server_args, self.device, self.C,  # None unless --enable-metrics
                                                   getattr(self.model_runner, "tp_rank", 0))
        # Hybrid drafting (the default): a per-request suffix lookup beside DLite, chosen per
        # request every round (sglang_dlite/lookup/). SGLANG_DLITE_LOOKUP=0 turns it off.
        self.lookup: Optional[BatchLookup] = None
        if lookup_enabled():
            self.lookup = BatchLookup(self.num_drafts, trace_path=os.environ.get(ENV_TRACE) or None,
                                      dlite_drafts=self.dlite_drafts)
        self._round_lookup = None
        # Per-round verify width (spec/verify_width.py): on a CPU a verify row is not free, so the
        # hybrid verifies only as many drafts as pay for their cost (learned online); fixed W on
        # GPUs (flat cost, one CUDA-graph shape). SGLANG_DLITE_VERIFY_WIDTH=fixed|adaptive|auto.
        self.width_policy: Optional[VerifyWidthPolicy] = None
        if self.lookup is not None and adaptive_width_wanted(
                str(self.device), bool(getattr(server_args, "disable_cuda_graph", False)),
                1 if self._tp is None else 2):
            self.width_policy = VerifyWidthPolicy(self.W)
        logger.info("DLITE drafting: %s; verify width %s", "hybrid (DLite + suffix lookup)" if self.lookup is not None
                    else f"DLite alone ({ENV_LOOKUP}=0)",
                    f"chosen per round, 2..{self.W}" if self.width_policy is not None else f"fixed at {self.W}")
        logger.info(
            "DLITE drafter %s: K=%d (verifying %d drafts per round), C=%d, target layers %s, dtype %s", path,
            self.drafter_block_size, self.num_drafts, self.C, cfg.target_layer_ids, dtype,
        )

    # ------------------------------------------------------------------ scheduler protocol
    @property
    def draft_worker(self):
        return None

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None,
                          token_to_kv_pool_allocator=None):
        # No draft pool: the verify slots come from the target's pools.
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def init_attention_backends(self):
        pass

    def init_cuda_graphs(self):
        use = (
            self.device != "cpu"
            and torch.cuda.is_available()
            and not getattr(self.server_args, "disable_cuda_graph", False)
            and os.environ.get("SGLANG_DLITE_DRAFT_CUDA_GRAPH", "1") != "0"
        )
        if use:
            max_bs = int(self.model_runner.max_running_requests or 64)
            self._graphs = DrafterCudaGraphs(self.drafter, min(max_bs, 256), self.device,
                                              self.model_runner.dtype, num_drafts=self.dlite_drafts,
                                              with_confidence=self.lookup is not None)
            logger.info("DLITE drafter CUDA graphs captured for batch sizes %s", self._graphs.buckets)

    def clear_cache_pool(self):
        pass

    # ------------------------------------------------------------------ helpers
    def _idle_input(self):
        return DLiteDraftInput.create_idle_input(self.device, self.state_width, self.C,
                                                 self.model_runner.dtype)

    def _prefill_state(self, hidden: torch.Tensor, extend_lens) -> torch.Tensor:
        """Last C captured rows of every request's extend segment (+ validity column)."""
        rows, valid = last_rows_of_segments(hidden, list(extend_lens), self.C)  # [B, C, L*H], [B, C]
        return torch.cat([rows, valid[..., None].to(hidden.dtype)], dim=-1)

    def _check_hidden(self, hidden: torch.Tensor, where: str) -> None:
        """Captured hidden states must be full-width ([tokens, L*H]) on every rank (under TP the
        decoder layers' outputs are all-reduced; a sharded capture would break the drafter)."""
        if hidden.shape[-1] != self.L * self.H:
            raise RuntimeError(
                f"DLITE: the target's captured hidden states in {where} are {tuple(hidden.shape)} on TP rank "
                f"{self.tp_rank}, expected [tokens, {self.L * self.H}] (L={self.L} layers x H={self.H}, full "
                "width); this target's TP layout shards them. Serve it with --tp-size 1.")

    def _tp_same(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Under TP: t identical on every rank (``tensor_parallel.same_on_all_ranks``)."""
        return same_on_all_ranks(self._tp, t, what, sync=self._tp_sync, check=self._tp_check)

    def _draft(self, state: torch.Tensor, anchors: torch.Tensor, batch=None) -> torch.Tensor:
        if self.lookup is not None and batch is not None:
            return self._draft_hybrid(state, anchors, batch)
        return self._draft_dlite(state, anchors)

    def _draft_hybrid(self, state: torch.Tensor, anchors: torch.Tensor, batch) -> torch.Tensor:
        """Per request: the suffix lookup, DLite, or DLite's prefix continued by the lookup,
        whichever is expected to be accepted more (lookup/chooser.py). DLite runs only when some
        request's lookup is not confident enough to skip it. Same [B, K] drafts for one verify."""
        seq = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else None
        idxs, lookups, need_dlite = self.lookup.begin_round(batch.reqs, anchors.tolist(), seq)
        d_toks = d_conf = None
        if need_dlite:
            d, conf = self._draft_dlite(state, anchors, with_confidence=True)
            d_toks, d_conf = d.tolist(), conf.float().tolist()
        cands = self.lookup.round_candidates(idxs, lookups, d_toks, d_conf)
        n = self.num_drafts
        if self.width_policy is not None:  # the width and each request's chain, chosen together
            n = self.width_policy.choose_expected(self.lookup.expected_table(cands, n)) - 1
        drafts, sources, _ = self.lookup.pick_round(idxs, cands, n)
        self._round_lookup = (idxs, drafts, sources)
        return torch.tensor(drafts, dtype=torch.int64, device=self.device).view(len(drafts), n)

    def _lookup_commit(self, batch, accepted: torch.Tensor) -> None:
        if self.lookup is None or self._round_lookup is None:
            return
        idxs, drafts, sources = self._round_lookup
        self._round_lookup = None
        self.lookup.commit(batch.reqs, idxs, drafts, accepted.tolist(), sources)
        if dlite_metrics.enabled():  # /metrics: rounds drafted by each source (suffix / dlite / mixed)
            for name in set(sources):
                dlite_metrics.record_source(name, sources.count(name))

    def _draft_dlite(self, state: torch.Tensor, anchors: torch.Tensor, with_confidence: bool = False):
        bs = state.shape[0]
        ctx = state[..., :-1].reshape(bs, self.C, self.L, self.H).permute(0, 2, 1, 3)
        valid = state[..., -1] > 0.5
        anchors = anchors.to(torch.int64)
        if self._graphs is not None and self._graphs.with_confidence == with_confidence:
            out = self._graphs.propose(ctx, valid, anchors)
            if out is not None:
                return (out[0].clone(), out[1].clone()) if with_confidence else out.clone()
        prop = self.drafter.propose(ctx.contiguous(), valid, anchors, num_drafts=self.dlite_drafts,
                                    return_confidence=with_confidence)
        return (prop.tokens, prop.confidence) if with_confidence else prop.tokens

    def _accept(self, drafts: torch.Tensor, logits: torch.Tensor, batch, prefix_lens):
        """drafts [B, W-1], processed logits [B, W, V] -> (accepted count a [B], bonus [B]):
        argmax, or sglang's own sampler per row (verify_logits.accept)."""
        info = batch.sampling_info
        sample_rows = None
        if not verify_logits.is_all_greedy(info):
            sample_rows = verify_logits.sglang_row_sampler(self.model_runner.sampler, info, logits.shape[1],
                                                           prefix_lens,
                                                           inplace=not batch.return_logprob)
        return verify_logits.accept(drafts, logits, sample_rows)

    # ------------------------------------------------------------------ the forward
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._forward_extend(batch, on_publish, pp_proxy_tensors)
        return self._forward_decode(batch, on_publish, grammar_barrier)

    @torch.no_grad()
    def _forward_extend(self, batch, on_publish, pp_proxy_tensors):
        out = self._target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        new_seq_lens = batch.seq_lens
        out.new_seq_lens = new_seq_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        if batch.forward_mode.is_idle():
            out.next_draft_input = self._idle_input()
            return out
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DLITE: the target returned no captured hidden states in prefill.")
        self._check_hidden(hidden, "prefill")
        state = self._prefill_state(hidden, batch.extend_lens)
        if self.lookup is not None:
            self.lookup.on_extend(batch.reqs)
        seq_lens_host = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        verify_logits.on_extend(batch.reqs, out.next_token_ids, seq_lens_host.tolist(),
                                int(batch.sampling_info.vocab_size))
        out.logits_output.hidden_states = None  # keep them off the CPU copy
        out.next_draft_input = DLiteDraftInput(
            bonus_tokens=out.next_token_ids.to(torch.int64), hidden_states=state,
            new_seq_lens=new_seq_lens,
        )
        return out

    @torch.no_grad()
    def _forward_decode(self, batch, on_publish, grammar_barrier=None):
        draft_input = batch.spec_info
        if draft_input is None and not batch.forward_mode.is_idle() and len(batch.reqs) > 0:
            raise RuntimeError(
                f"DLITE: a decode batch of {len(batch.reqs)} requests carries no DLITE draft state "
                "(batch.spec_info is None): it was not prefilled through the DLITE worker.")
        if batch.forward_mode.is_idle() or len(batch.reqs) == 0:
            empty = self._idle_input()
            if on_publish is not None:
                on_publish(empty.new_seq_lens)
            return GenerationBatchResult(
                logits_output=None, next_token_ids=torch.empty((0,), dtype=torch.int64, device=self.device),
                accept_lens=torch.empty((0,), dtype=torch.int32, device=self.device),
                next_draft_input=empty, can_run_cuda_graph=False,
                speculative_num_draft_tokens=self.W, new_seq_lens=empty.new_seq_lens,
            )
        if not isinstance(draft_input, DLiteDraftInput):
            raise RuntimeError(f"DLITE expected DLiteDraftInput on the running batch, got {type(draft_input)}")
        bs = len(batch.reqs)
        device = self.device
        prefix_lens = batch.seq_lens
        state = draft_input.hidden_states
        anchors = draft_input.bonus_tokens.to(torch.int64)

        rt = self._metrics.start() if self._metrics is not None else None  # --enable-metrics only
        # 1) draft
        drafts = self._draft(state, anchors, batch).to(torch.int64)  # [B, K] (the first K = W-1 of the chain)
        drafts = self._tp_same(drafts, "drafts")  # TP: every rank verifies the same block
        K = drafts.shape[1]  # drafts verified this round (W - 1 unless the width policy cut it)
        W = K + 1
        if rt is not None:
            rt.mark()
        block = torch.cat([anchors[:, None], drafts], dim=1)  # [B, W]
        grammar_tree = verify_logits.grammar_tree(batch, block)  # host copy starts before verify

        # 2) verify
        from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func

        offsets = torch.arange(W, device=device, dtype=prefix_lens.dtype)
        positions = (prefix_lens[:, None] + offsets[None, :]).reshape(-1)
        out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens, end_offset=prefix_lens + W,
            batch_size=bs, draft_token_num=W, device=device,
        )
        verify_input = DLiteVerifyInput(
            draft_token=block.reshape(-1), positions=positions, draft_token_num=W,
            custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        batch.out_cache_loc = out_cache_loc
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        try:  # the verify input sees the lengths after the W verify tokens; the batch keeps its own
            if seq_lens_cpu_backup is not None:
                host = seq_lens_cpu_backup + W
                batch.seq_lens_cpu = host
                batch.seq_lens_sum = int(host.sum())
            # Attention metadata is planned once per verify: eager TARGET_VERIFY plans it inside the
            # target's forward (eager_runner._execute_extend re-plans every verify), so plan here
            # only for a CUDA-graph replay.
            fb, can_graph = verify_input.prepare_for_verify(batch, self._target_worker, defer_metadata_init=True)
            if can_graph:
                self.model_runner.decode_cuda_graph_runner.load_batch(fb)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
        t_verify = time.perf_counter()
        target_out = self._target_worker.forward_batch_generation(
            batch=None, forward_batch=fb, is_verify=True,
        )
        logits_output = target_out.logits_output
        if self.width_policy is not None:  # CPU: the forward has finished when it returns
            self.width_policy.observe(bs * W, time.perf_counter() - t_verify)
        if rt is not None:
            rt.mark()
        logits = logits_output.next_token_logits.view(bs, W, -1)

        # 3) accept: penalties / grammar / logit_bias / custom processors on all W rows, then choose
        gmask = verify_logits.grammar_mask(batch, grammar_tree, logits.device, grammar_barrier)
        verify_logits.process(logits_output.next_token_logits, W, batch, block, prefix_lens, gmask)
        a, bonus = self._accept(drafts, logits, batch, prefix_lens)
        if self._tp is not None:  # TP: the same accept lengths and bonus tokens on every rank
            ab = self._tp_same(torch.stack([a.to(torch.int64), bonus.to(torch.int64)]), "accept lengths / bonus tokens")
            a, bonus = ab[0].to(a.dtype), ab[1].to(bonus.dtype)
        commit_lens = (a + 1).to(torch.int32)
        out_tokens = torch.zeros((bs, W), dtype=torch.int64, device=device)
        out_tokens[:, :K] = drafts
        out_tokens.scatter_(1, a[:, None], bonus[:, None])
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        self._lookup_commit(batch, a)
        verify_logits.commit(batch.reqs, out_tokens, a)

        if batch.return_logprob:
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=W)
        if on_publish is not None:
            on_publish(new_seq_lens)

        # 4) carry: last C rows of [old context, verify rows 0..a]
        hv = logits_output.hidden_states
        if hv is None:
            raise RuntimeError("DLITE: the target verify returned no captured hidden states.")
        self._check_hidden(hv, "verify")
        hv = hv.view(bs, W, -1).to(state.dtype)
        ones = torch.ones((bs, W, 1), dtype=state.dtype, device=device)
        cat = torch.cat([state, torch.cat([hv, ones], dim=-1)], dim=1)  # [B, C+W, D+1]
        idx = (a + 1)[:, None] + torch.arange(self.C, device=device)[None, :]
        new_state = cat.gather(1, idx[..., None].expand(-1, -1, cat.shape[-1]))
        logits_output.hidden_states = None

        next_draft_input = DLiteDraftInput(
            bonus_tokens=bonus, hidden_states=new_state, new_seq_lens=new_seq_lens,
        )
        if rt is not None:
            rt.finish(bs, state[..., -1])
        batch.forward_mode = ForwardMode.DECODE
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=W,
            new_seq_lens=new_seq_lens,
        )

