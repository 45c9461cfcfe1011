"""The DLITE spec-v2 worker: the target forward, the DLite drafter, chain verify, accept.

There is no draft model runner, no draft KV pool and no draft attention backend. Per request the
drafter's state is the bonus token and the target's hidden states of the last C committed
positions (``info.DLiteDraftInput``), carried through ``filter_batch`` / ``merge_batch`` and the
overlap relay. Invariant between rounds (the same as the reference engine's,
``dlite_lab/reference/engine.py``): the target KV covers ``seq_lens`` tokens; the anchor (bonus token) is
the next one and is not yet in the KV; the context hidden states are those of positions
``seq_lens - C .. seq_lens - 1``.

Round (decode batch), one body for both kinds of round (``rounds.py``: ``ChainRounds``, and
``TreeRounds`` for greedy or sampled batches of up to ``tree_max_batch_size`` requests):
  1. plan   : how many drafts (``budget.LoadPolicy``, the per-request opt-out, on a CPU the draft gate);
  2. draft  : the kind's ``Round``: per request a chain [anchor, d_1..d_n] (n + 1 <= W; hybrid by
              default: the suffix lookup's chain, DLite's, or DLite's prefix continued by the lookup)
              or a token tree (the lookup's continuations + DLite's top-k), W rows at most;
  3. verify : one TARGET_VERIFY forward over those rows (``_verify``), written to the W KV slots the
              scheduler reserved (``eagle_prepare_for_decode``), capturing the drafter's target
              layers (FULL capture); a tree's nodes at positions prefix + depth under its mask;
  4. accept : every sglang logits adjustment on every row (penalties with the drafts counted,
              grammar mask, logit_bias, custom processors: ``verify_logits.py``), then the longest
              chain / root path equal to the target's per-row choice (argmax, or sglang's sampler);
              the bonus token comes from the target;
  5. learn  : online learning from the round (the setting ``online``: ``online_serving.py``);
  6. commit : the kind's KV (a tree's accepted path moved to the front), the lookup, the penalty state;
  7. carry  : new context = last C rows of [old context, verify rows 0..a] (anchor + accepted;
              ``drafting.context.roll_last_rows``).
The settings (``SGLANG_DLITE_CONFIG``) are read once, when the worker starts (``settings.ServingOptions``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_dlite import ops
from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.drafting.hybrid import BatchLookup
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.context import last_rows_of_segments, roll_last_rows
from sglang_dlite.drafting.budget import DraftGate, VerifyWidthPolicy
from sglang_dlite.serving.algorithm import capture_target_layers, check_target_supported, max_verify_width
from sglang_dlite.serving import metrics as dlite_metrics
from sglang_dlite.serving import spec_metrics
from sglang_dlite.serving import verify_logits
from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs
from sglang_dlite.serving.info import DLiteDraftInput, DLiteVerifyInput, pack_context
from sglang_dlite.drafting.budget import LoadPolicy, opted_out
from sglang_dlite.serving.online_serving import OnlineServing
from sglang_dlite.serving.rounds import ChainRounds, TreeRounds
from sglang_dlite.settings import ServingOptions, drafter_dtype
from sglang_dlite.serving.tensor_parallel import (check_gathered_embedding, drafter_memory, gather_vocab_rows, same_on_all_ranks,
                              target_parts, tp_group)

logger = logging.getLogger(__name__)


class DLiteWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self.options = ServingOptions.from_env()  # every setting, read once, here
        ops.set_ops_mode(self.options.ops)  # the kernels the drafter's ops run in this scheduler process
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        spec = get_spec()
        path = spec.speculative_draft_model_path
        self.drafter = self._load_drafter(path)
        cfg = self.drafter.config
        self._set_round_shape(cfg, int(spec.speculative_num_draft_tokens))
        capture_target_layers(self.model_runner.model, cfg.target_layer_ids)  # before the target's CUDA graphs
        self.graphs: Optional[DrafterCudaGraphs] = None
        self._metrics = dlite_metrics.worker_timer(server_args, self.device, self.C,  # None unless --enable-metrics
                                                   getattr(self.model_runner, "tp_rank", 0), self.options)
        self._init_hybrid()
        self.online, self.drafter = OnlineServing.attach(self.options, self.drafter, self.lookup)  # on: drafts adapt
        self.load = LoadPolicy(self.options)
        tree_bs = self.options.tree_batch_size(self.device) if self.tp is None else 0  # TP: chains
        self.chains = ChainRounds(self)
        self.trees = TreeRounds(self, tree_bs, self.options.tree_branches) if tree_bs else None
        spec_metrics.configure(self.options.spec_metrics, self.num_drafts)  # per-response metrics (and /metrics')
        if self.tp_rank == 0:
            logger.info("DLITE settings: %s", self.options.describe())
        logger.info(
            "DLITE drafter %s: K=%d (verifying %d drafts per round), C=%d, target layers %s, dtype %s", path,
            self.drafter_block_size, self.num_drafts, self.C, cfg.target_layer_ids, self.draft_dtype,
        )

    # ------------------------------------------------------------------ start-up steps
    def _load_drafter(self, path) -> DLiteDrafter:
        """The drafter in its serving dtype, checked, bound to the target (``_bind_target``)."""
        hf = self.model_runner.model_config.hf_text_config
        dtype = drafter_dtype(self.model_runner.dtype, self.device, self.options)
        drafter = DLiteDrafter.from_pretrained(path, dtype=dtype, device=self.device)
        self.draft_dtype = dtype
        logger.info("DLITE drafter dtype %s (target %s; the setting drafter_dtype)", dtype, self.model_runner.dtype)
        cfg = drafter.config
        cfg.check_target(hidden_size=hf.hidden_size, vocab_size=hf.vocab_size,
                         num_layers=hf.num_hidden_layers)
        check_target_supported(self.model_runner, cfg, self.server_args)
        if cfg.history_window != 0:
            raise DLiteConfigError(
                f"DLITE serves history-free drafters only; {path!r} has history={cfg.history!r} "
                "(a teacher / sliding-window ablation checkpoint)."
            )
        self._bind_target(drafter)
        if str(self.device).startswith("cpu") and ops.ops_mode() != "torch":  # bf16 GEMMs on prepacked weights
            ops.pack_cpu_linears(drafter)
        return drafter

    def _bind_target(self, drafter: DLiteDrafter) -> None:
        """sglang pads the vocabulary rows (to a multiple of 64 per TP rank): bind the real ones.
        Under tensor parallelism both are vocabulary-sharded: every rank gathers a full copy once
        (padding stripped), so drafting needs no collective; the copy is that rank's extra memory."""
        model = self.model_runner.model
        embed_w, head_w = target_parts(model)
        V = drafter.config.vocab_size
        self.tp = tp_group(self.model_runner)
        self.tp_rank = 0 if self.tp is None else int(self.tp.rank_in_group)
        embed_full = gather_vocab_rows(embed_w, V, self.tp)
        head_full = embed_full if head_w is embed_w else gather_vocab_rows(head_w, V, self.tp)
        if self.tp is not None:
            check_gathered_embedding(getattr(model, "model", model).embed_tokens, embed_full)
        drafter.bind_target(embed_full, head_full)
        self._tp_sync = self.tp is not None and self.options.tp_sync
        self._tp_check = self.tp is not None and self.options.tp_check
        self.drafter_memory = drafter_memory(drafter, self.tp, (embed_w, head_w), embed_full, head_full)
        logger.info("DLITE drafter memory on TP rank %d: %.1f MiB weights (replicated) + %.1f MiB gathered "
                    "target embedding/LM head", self.tp_rank, self.drafter_memory["drafter_weights_mib"],
                    self.drafter_memory["gathered_vocab_copies_mib"])

    def _set_round_shape(self, cfg, W: int) -> None:
        """Tokens verified per round, at most (anchor + the first W-1 drafts of the chain):
        --speculative-num-draft-tokens or algorithm.default_num_draft_tokens. With the lookup on, a
        chain may run past DLite's K drafts (the lookup continues it), up to max_verify_width."""
        self.drafter_block_size = cfg.block_size  # K: drafts the drafter can make per round
        self.W = W
        self.num_drafts = self.W - 1  # chain length verified per round (at most)
        self.dlite_drafts = min(self.num_drafts, self.drafter_block_size)  # drafts DLite makes per pass
        self.C = cfg.num_context_positions
        self.L = cfg.num_capture_layers
        self.H = cfg.target_hidden_size
        self.state_width = self.L * self.H + 1
        lookup = self.options.lookup
        w_max = max_verify_width(self.drafter_block_size, lookup)
        if not 2 <= self.W <= w_max:
            raise DLiteConfigError(
                f"DLITE: speculative_num_draft_tokens={self.W} but the drafter has K={self.drafter_block_size} "
                f"(needs 2..{w_max}{'' if lookup else ' with the setting lookup: false'})."
            )

    def _init_hybrid(self) -> None:
        """Hybrid drafting (the default; lookup/): a per-request suffix lookup beside DLite. On a CPU
        the verify width is chosen per round (drafting/budget.py), fixed W on GPUs."""
        self.lookup: Optional[BatchLookup] = None
        if self.options.lookup:
            self.lookup = BatchLookup(self.num_drafts, trace_path=self.options.lookup_trace,
                                      dlite_drafts=self.dlite_drafts, corpus_tokens=self.options.corpus_tokens)
        adaptive = self.options.adaptive_width(self.device, bool(getattr(self.server_args, "disable_cuda_graph", False)),
                                               1 if self.tp is None else 2)
        self.width_policy = VerifyWidthPolicy(self.W) if adaptive and self.lookup is not None else None
        # where a verify row is not free (a CPU), also whether to draft at all: it must pay
        self.gate = DraftGate(width_policy=self.width_policy) if adaptive else None
        self._last_round = None  # the decode round before, for the gate: (bs, drafted, start, committed per request)
        logger.info("DLITE drafting: %s; verify width %s%s", self.options.describe_drafting(),
                    f"chosen per round, 2..{self.W}" if self.width_policy is not None else f"fixed at {self.W}",
                    "; rounds without drafts where drafting does not pay" if adaptive else "")

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
            and self.options.draft_cuda_graph
        )
        if use:
            max_bs = int(self.model_runner.max_running_requests or 64)
            self.graphs = DrafterCudaGraphs(self.drafter, min(max_bs, 256), self.device,
                                             self.model_runner.dtype, num_drafts=self.dlite_drafts,
                                             with_confidence=self.lookup is not None)
            logger.info("DLITE drafter CUDA graphs captured for batch sizes %s", self.graphs.buckets)

    def clear_cache_pool(self):
        pass

    # ------------------------------------------------------------------ helpers
    def _idle_input(self):
        return DLiteDraftInput.create_idle_input(self.device, self.state_width, self.C,
                                                 self.model_runner.dtype)

    def _check_hidden(self, hidden: torch.Tensor, where: str) -> None:
        """Captured hidden states must be full-width ([tokens, L*H]) on every rank (under TP the
        decoder layers' outputs are all-reduced; a sharded capture would break the drafter)."""
        if hidden.shape[-1] != self.L * self.H:
            raise RuntimeError(
                f"DLITE: the target's captured hidden states in {where} are {tuple(hidden.shape)} on TP rank "
                f"{self.tp_rank}, expected [tokens, {self.L * self.H}] (L={self.L} layers x H={self.H}, full "
                "width); this target's TP layout shards them. Serve it with --tp-size 1.")

    def tp_same(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Under TP: t identical on every rank (``tensor_parallel.same_on_all_ranks``)."""
        return same_on_all_ranks(self.tp, t, what, sync=self._tp_sync, check=self._tp_check)

    # ------------------------------------------------------------------ the forward
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._forward_extend(batch, on_publish, pp_proxy_tensors)
        return self._forward_decode(batch, on_publish, grammar_barrier)

    @torch.no_grad()
    def _forward_extend(self, batch, on_publish, pp_proxy_tensors):
        self._last_round = None  # a prefill between two decode rounds is not part of a round's period
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
        state = pack_context(*last_rows_of_segments(hidden, list(batch.extend_lens), self.C))  # last C rows each
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
        """One decode round, a chain or a tree (``rounds.py``): plan -> draft -> verify -> accept ->
        learn -> commit -> carry (see the module docstring)."""
        draft_input = self._decode_input(batch)
        if draft_input is None:
            return self._idle_result(on_publish)
        bs = len(batch.reqs)
        prefix_lens = batch.seq_lens
        state = draft_input.hidden_states
        anchors = draft_input.bonus_tokens.to(torch.int64)

        rt = self._metrics.start() if self._metrics is not None else None  # metrics or the round log only
        t_round = time.perf_counter()
        n, opt_out = self._plan_round(batch, bs, t_round)  # 1) plan
        kind = self.trees if self.trees is not None and self.trees.wanted(batch, bs, n, opt_out) else self.chains
        rd = kind.draft(batch, state, anchors, n)  # 2) draft
        W = rd.tokens.shape[1]  # rows verified per request this round
        if rt is not None:
            rt.mark()
        target_out = self._verify(batch, rd.tokens, prefix_lens, rd.positions, rd.mask)  # 3) verify
        logits_output = target_out.logits_output
        if rt is not None:
            rt.mark()
        a, bonus, out_tokens = kind.accept(rd, batch, prefix_lens, logits_output, grammar_barrier, opt_out)  # 4)
        if self.online is not None:  # 5) learn (the setting online, online_serving.py)
            kind.learn(rd, state, anchors, logits_output, a, out_tokens, opt_out)
        if self.gate is not None:  # a CPU: the draft and the verify have finished
            self._last_round = (bs, rd.drafted, t_round, 1.0 + float(a.float().mean()))
        kind.commit(rd, batch, a, out_tokens)  # 6) commit
        if spec_metrics.wanted(batch.reqs):  # per request: what it verified, accepted, who drafted (host lists)
            spec_metrics.attach(logits_output, spec_metrics.round_stats(
                rd, a, None if opt_out is None else [opted_out(r) for r in batch.reqs]))
        commit_lens = (a + 1).to(torch.int32)
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        if batch.return_logprob:  # chains only (a tree round takes no logprob batch)
            compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=W)
        if on_publish is not None:
            on_publish(new_seq_lens)
        kind.carried_rows(rd, logits_output)  # 7) carry: the accepted rows first, then the last C
        new_state = self._carry(state, logits_output, a)
        if rt is not None:
            rt.finish(bs, state[..., -1], W, tree=rd.tree, reqs=batch.reqs, round_accepted=a,
                      learn=None if self.online is None else self.online.take_round())
        batch.forward_mode = ForwardMode.DECODE
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=DLiteDraftInput(bonus_tokens=bonus, hidden_states=new_state, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=W,
            new_seq_lens=new_seq_lens,
        )

    # ------------------------------------------------------------------ round steps
    def _plan_round(self, batch, bs: int, now: float):
        """(drafts per request this round, at most; the rows that opted out, or None):
        ``budget.LoadPolicy``, then on a CPU the draft gate (``drafting.budget.DraftGate``), which
        is told the last decode round's whole period (draft, verify and the scheduler's work around
        them, so a round without drafts pays its share of the fixed cost) unless a prefill came between
        (``_forward_extend`` forgets the round) or it took over a second."""
        last, self._last_round = self._last_round, None
        if last is not None and now - last[2] < 1.0:
            self.gate.observe(last[0], last[1], now - last[2], last[3])
        opt_out = self.load.opted_out_rows(batch.reqs, self.device)
        if opt_out is not None and bool(opt_out.all()):
            return 0, opt_out
        n = self.load.num_drafts(bs, self.num_drafts)
        if n and self.gate is not None and not self.gate.should_draft(bs):
            n = 0
        return n, opt_out

    def _decode_input(self, batch) -> Optional[DLiteDraftInput]:
        """The batch's carried draft state; None for an idle / empty batch."""
        draft_input = batch.spec_info
        if draft_input is None and not batch.forward_mode.is_idle() and len(batch.reqs) > 0:
            raise RuntimeError(
                f"DLITE: a decode batch of {len(batch.reqs)} requests carries no DLITE draft state "
                "(batch.spec_info is None): it was not prefilled through the DLITE worker.")
        if batch.forward_mode.is_idle() or len(batch.reqs) == 0:
            return None
        if not isinstance(draft_input, DLiteDraftInput):
            raise RuntimeError(f"DLITE expected DLiteDraftInput on the running batch, got {type(draft_input)}")
        return draft_input

    def _idle_result(self, on_publish) -> GenerationBatchResult:
        empty = self._idle_input()
        if on_publish is not None:
            on_publish(empty.new_seq_lens)
        return GenerationBatchResult(
            logits_output=None, next_token_ids=torch.empty((0,), dtype=torch.int64, device=self.device),
            accept_lens=torch.empty((0,), dtype=torch.int32, device=self.device),
            next_draft_input=empty, can_run_cuda_graph=False,
            speculative_num_draft_tokens=self.W, new_seq_lens=empty.new_seq_lens,
        )

    def _verify(self, batch, block: torch.Tensor, prefix_lens: torch.Tensor, positions=None, custom_mask=None):
        """One TARGET_VERIFY forward over block [B, W] (a chain's [anchor, drafts], or a tree's nodes
        with their positions and attention mask: ``rounds.Round``), written to the W KV slots after
        each request's prefix, capturing the drafter's target layers."""
        bs, W = block.shape
        device = self.device
        if positions is None:
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
            custom_mask=custom_mask, topk=1 if custom_mask is None else 2,  # backends read a tree's mask at topk > 1
            capture_hidden_mode=CaptureHiddenMode.FULL,
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
        if self.width_policy is not None:  # CPU: the forward has finished when it returns
            self.width_policy.observe(bs * W, time.perf_counter() - t_verify)
        return target_out

    def _carry(self, state: torch.Tensor, logits_output, a: torch.Tensor) -> torch.Tensor:
        """The next round's context: the last C rows of [old context, verify rows 0..a]
        (``drafting.context.roll_last_rows``; rows carry their validity column, 1.0)."""
        hv = logits_output.hidden_states
        if hv is None:
            raise RuntimeError("DLITE: the target verify returned no captured hidden states.")
        self._check_hidden(hv, "verify")
        hv = hv.view(state.shape[0], -1, hv.shape[-1]).to(state.dtype)
        logits_output.hidden_states = None
        return roll_last_rows(state, pack_context(hv, torch.ones(hv.shape[:2], dtype=torch.bool, device=self.device)),
                              a + 1)
