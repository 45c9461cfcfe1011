"""Tree rounds for the DLITE worker: one token tree per request, verified in one TARGET_VERIFY pass.

Per request the round grows a tree (``drafting.hybrid_tree.grow_round_tree``) from the suffix
lookup's continuations (ranked by occurrence counts, branching where they split) and DLite's
top-k along its greedy chain (``ChainBranches``: the batch's one drafter pass with
``propose(top_k=k)``, no model call while the trees grow), best-first by calibrated reach within
``N - 1`` drafts, N the round's rows per request: the W KV slots the scheduler reserves, or on a CPU
as many as pay by the verify width's cost model (``VerifyWidthPolicy.choose_expected`` on each
tree's expected accepted drafts by node count: the best-first trees are cut to their first N nodes).
Every tree is padded to N rows: a padding node is a child of the root that acceptance never
takes. Then:

  verify : TARGET_VERIFY over the nodes at positions prefix + depth, under the tree's attention
           mask (a node sees the prefix and its root path; on a CPU the draft-only [N, N] mask that
           sglang's NGRAM worker passes there, elsewhere the prefix + tree mask of its GPU path);
  accept : every logits adjustment sglang makes, per node (``verify_logits.process`` with the
           tree's parents: penalties over the node's root path, min_new_tokens at its depth, the
           grammar mask over the tree, logit_bias, custom processors), then one choice per node
           (argmax, or sglang's own sampler at position prefix + depth) and the longest root path
           whose every token equals the choice at its parent (``drafting.tree.greedy_tree_accept``),
           the bonus the choice at its last node: the target's law, see ``verify_logits``;
  commit : the path's KV moved to the slots after the prefix (sglang's
           ``move_accept_tokens_to_target_kvcache``, as NGRAM): the rejected branches' slots are
           the next round's to overwrite, like a chain's rejected drafts; the lookup takes the path;
  carry  : the path's captured rows become DLite's context (``worker._carry``).

With online learning (``online_serving.py``) the trees come from the learner's adapted copy, or from
the shipped drafter while the tree gate says the adapted trees lose (``OnlineServing.tree_gate``: one
round in ``watch_every`` grows both and judges the one not verified against what the round committed).

Which rounds: ``TreeRounds.wanted`` -- batches of at most ``tree_max_batch_size`` requests with
drafts, no logprobs and no opt-out, greedy or sampled, with any penalty, grammar, logit_bias or
custom processor; every other round is a chain (``worker._forward_decode``), so what a tree round
does not handle is never served by it.
"""

from __future__ import annotations

import itertools
from typing import List

import torch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from sglang_dlite.drafting.chooser import default_calibration
from sglang_dlite.drafting.hybrid_tree import ChainBranches, grow_round_tree
from sglang_dlite.drafting.tree import DraftTree, greedy_tree_accept
from sglang_dlite.serving import verify_logits
from sglang_dlite.serving import metrics as dlite_metrics
from sglang_dlite.serving.info import DLiteDraftInput, unpack_context


def tree_arrays(trees: List[DraftTree], rows: int):
    """Trees padded to ``rows`` nodes each -> (tokens [B, rows], depths [B, rows], ancestry
    [B, rows, rows] bool: entry (i, j) when node j is on node i's root path, parents [B, rows]).
    Padding nodes are children of the root carrying the root's token."""
    B = len(trees)
    tokens = torch.empty(B, rows, dtype=torch.int64)
    depths = torch.ones(B, rows, dtype=torch.int64)
    parents = torch.zeros(B, rows, dtype=torch.int64)
    anc = torch.zeros(B, rows, rows, dtype=torch.bool)
    for b, tree in enumerate(trees):
        n = len(tree)
        tokens[b] = tree.tokens[0]
        tokens[b, :n] = torch.tensor(tree.tokens)
        depths[b, 0] = 0
        depths[b, :n] = torch.tensor(tree.depths)
        parents[b, :n] = torch.tensor(tree.parents)
        anc[b, :n, :n] = tree.ancestry()
        anc[b, n:, 0] = True
        idx = torch.arange(n, rows)
        anc[b, idx, idx] = True
    return tokens, depths, anc, parents


def verify_mask(anc: torch.Tensor, prefix_lens: List[int], device, draft_only: bool) -> torch.Tensor:
    """The custom mask of a tree verify, flattened bool: per request its [N, N] ancestry
    (``draft_only``: what sglang's NGRAM worker passes on a CPU and the CPU verify hook reads) or
    [N, prefix + N] with the prefix all allowed (NGRAM's full mask elsewhere)."""
    if draft_only:
        return anc.reshape(-1).to(device)
    N = anc.shape[1]
    parts = [torch.cat([torch.ones(N, int(p), dtype=torch.bool), anc[b]], dim=1).reshape(-1)
             for b, p in enumerate(prefix_lens)]
    return torch.cat(parts).to(device)


def expected_by_rows(reaches: List[List[float]]) -> List[List[float]]:
    """Per request, the expected accepted drafts when its tree's first n nodes are verified
    (n = 0 .. nodes): the running sum of the nodes' reach (``grow_tree`` adds them in order of
    falling reach, so the first n nodes are the best n and a tree). The verify width policy's table."""
    return [list(itertools.accumulate(r[1:], initial=0.0)) for r in reaches]


def first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first ``n`` nodes, the root included (a tree: every parent comes first)."""
    return tree if len(tree) <= n else DraftTree(tree.tokens[:n], tree.parents[:n])


class TreeRounds:
    """The worker's tree rounds (module docstring); ``worker`` is the ``DLiteWorker``."""

    def __init__(self, worker, max_batch_size: int, branches: int = 4):
        self.w = worker
        self.max_batch_size = int(max_batch_size)
        self.branches = int(branches)
        self.rows = int(worker.W)  # tree nodes + the root, per request, at most (the reserved KV slots)
        self.round_rows = self.rows  # N: this round's
        self.cal = worker.lookup.cal if worker.lookup is not None else default_calibration()
        self._judge = None  # a judged round of the online tree gate: (the other trees, the adapted ones verified?)

    def wanted(self, batch, bs: int, n: int, opt_out) -> bool:
        """Whether this round is a tree round (module docstring)."""
        return n > 0 and opt_out is None and bs <= self.max_batch_size and not batch.return_logprob

    def draft(self, batch, state: torch.Tensor, anchors: torch.Tensor) -> List[DraftTree]:
        """One tree per request: the lookup's continuations + DLite's top-k along its chain."""
        w = self.w
        anchor_list = anchors.tolist()
        idxs = [None] * len(anchor_list)
        if w.lookup is not None:
            seq = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else None
            idxs, _, _ = w.lookup.begin_round(batch.reqs, anchor_list, seq, lookup=False)
        ctx, valid = unpack_context(state, w.L, w.H)
        ctx = ctx.contiguous()
        # online learning's tree gate (online_serving.tree_gate): the adapted copy's tree or the shipped one
        gate = None if w.online is None else w.online.tree_gate(len(anchor_list))
        adapted = gate is None or gate[0]
        trees, reaches, self._sources = self._grow(w.drafter if adapted else w.online.shipped, idxs, ctx, valid,
                                                   anchors, anchor_list)
        self._idxs = idxs
        self.round_rows = self.rows
        if w.width_policy is not None:  # a CPU: as many rows as pay, from the verify width's cost model
            self.round_rows = w.width_policy.choose_expected(expected_by_rows(reaches))
            trees = [first_nodes(t, self.round_rows) for t in trees]
        self.round_rows = max(len(t) for t in trees)  # no round pads every tree
        self._judge = None
        if gate is not None and gate[1]:  # judged: the other model's trees, cut to this round's rows
            others, _, _ = self._grow(w.online.shipped if adapted else w.drafter, idxs, ctx, valid, anchors,
                                      anchor_list)
            self._judge = ([first_nodes(t, self.round_rows) for t in others], adapted)
        return trees

    def _grow(self, model, idxs, ctx, valid, anchors, anchor_list):
        """Per request a tree from ``model``'s top-k along its chain and the lookup -> (trees, reaches, sources)."""
        w = self.w
        prop = model.propose(ctx, valid, anchors, num_drafts=w.dlite_drafts, top_k=self.branches)
        top_t, top_p = prop.top_tokens.tolist(), prop.top_probs.float().tolist()
        trees, reaches, sources = [], [], []
        for b, anchor in enumerate(anchor_list):
            tree, reach, source = grow_round_tree(anchor, idxs[b], ChainBranches(top_t[b], top_p[b]), self.cal,
                                                  self.branches, self.rows - 1)
            trees.append(tree)
            reaches.append(reach)
            sources.append(source)
        return trees, reaches, sources

    def verify(self, batch, trees: List[DraftTree], prefix_lens: torch.Tensor):
        """One TARGET_VERIFY forward over every request's padded tree (``worker._verify``); keeps the
        tree's layout for ``accept`` and starts the grammar tree (host) before the launch."""
        w = self.w
        tokens, depths, anc, parents = tree_arrays(trees, self.round_rows)
        device = w.device
        self._layout = (tokens.to(device), depths.to(device), parents.to(device))
        self._grammar = verify_logits.grammar_tree(batch, tokens, parents, [len(t) for t in trees])
        host_prefix = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else prefix_lens.cpu()).tolist()
        positions = (prefix_lens[:, None].to(torch.int64) + self._layout[1]).reshape(-1)
        mask = verify_mask(anc, host_prefix, device, draft_only=str(device).startswith("cpu"))
        return w._verify(batch, self._layout[0], prefix_lens, positions=positions, custom_mask=mask)

    def choices(self, batch, prefix_lens: torch.Tensor, logits_output, grammar_barrier=None) -> torch.Tensor:
        """Every sglang logits adjustment on every node's row, in place, then the target's choice
        per node [B, N] (host): argmax, or sglang's sampler at position prefix + depth."""
        w = self.w
        logits = logits_output.next_token_logits
        tokens, depths, parents = self._layout
        gmask = verify_logits.grammar_mask(batch, self._grammar, logits.device, grammar_barrier)
        N = tokens.shape[1]
        verify_logits.process(logits, N, batch, tokens, prefix_lens, gmask, parents=parents)
        info = batch.sampling_info
        if verify_logits.is_all_greedy(info):
            return logits.view(-1, N, logits.shape[-1]).argmax(-1).cpu()
        sample = verify_logits.sglang_row_sampler(w.model_runner.sampler, info, N, prefix_lens,
                                                  inplace=w.online is None, depths=depths)  # online reads logits
        return sample(logits).view(-1, N).cpu()

    def accept(self, trees: List[DraftTree], target: torch.Tensor):
        """Tree acceptance per request against the target's choice per node ``target`` [B, N] ->
        (accepted drafts a [B], bonus [B], the path's node index per committed token [B, N] (-1
        past it), output tokens [B, N])."""
        B, N = len(trees), self.round_rows
        a, bonus = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        path_idx = torch.full((B, N), -1, dtype=torch.int64)
        out = torch.zeros(B, N, dtype=torch.int64)
        self._paths = []
        for b, tree in enumerate(trees):
            path, bon = greedy_tree_accept(tree, target[b, :len(tree)])
            committed = tree.committed(path, bon)
            a[b], bonus[b] = len(path) - 1, bon
            path_idx[b, :len(path)] = torch.tensor(path)
            out[b, :len(committed)] = torch.tensor(committed)
            self._paths.append(committed[:-1])
        return a, bonus, path_idx, out

    def commit(self, batch, a: torch.Tensor, path_idx: torch.Tensor) -> None:
        """The path's KV to the slots after each prefix; the lookup takes the accepted drafts."""
        w = self.w
        B, N = path_idx.shape
        flat = torch.where(path_idx >= 0, path_idx + N * torch.arange(B)[:, None], -1)  # rows of the B*N verify
        move_accept_tokens_to_target_kvcache(batch, flat.to(torch.int32).to(w.device), a.to(w.device),
                                             w.model_runner.token_to_kv_pool_allocator)
        if w.lookup is not None:
            w.lookup.commit(batch.reqs, self._idxs, self._paths, a.tolist(), self._sources)

    @staticmethod
    def path_rows(hidden: torch.Tensor, path_idx: torch.Tensor, B: int) -> torch.Tensor:
        """Captured verify rows [B*N, D] -> the path's rows first, [B, N, D] (what ``_carry`` rolls in)."""
        hv = hidden.view(B, -1, hidden.shape[-1])
        idx = path_idx.clamp(min=0).to(hv.device)
        return hv.gather(1, idx[:, :, None].expand(-1, -1, hv.shape[-1]))

    def run(self, batch, state: torch.Tensor, anchors: torch.Tensor, prefix_lens: torch.Tensor, on_publish, rt,
            t_round: float, grammar_barrier=None) -> GenerationBatchResult:
        """One tree round (module docstring): draft, verify, accept, commit, carry."""
        w, bs = self.w, len(batch.reqs)
        trees = self.draft(batch, state, anchors)
        N = self.round_rows
        if rt is not None:
            rt.mark()
        target_out = self.verify(batch, trees, prefix_lens)
        lo = target_out.logits_output
        if rt is not None:
            rt.mark()
        a, bonus, path_idx, out = self.accept(trees, self.choices(batch, prefix_lens, lo, grammar_barrier))
        if w.online is not None:  # the setting online: learn from the accepted path (online_serving.py)
            w.online.observe_tree(state, anchors, out, path_idx, a, lo.next_token_logits.view(bs, N, -1))
            if self._judge is not None:  # the tree gate's judged round: the other trees against what was committed
                w.online.judge_trees(*self._judge, out, a)
        if w.gate is not None:  # a CPU: the draft and the verify have finished
            w._last_round = (bs, True, t_round, 1.0 + float(a.float().mean()))
        self.commit(batch, a, path_idx)
        dlite_metrics.record_sources(self._sources)
        dev = w.device
        a, bonus, out = a.to(dev), bonus.to(dev), out.to(dev)
        verify_logits.commit(batch.reqs, out, a)  # the penalty state takes the committed tokens
        commit_lens = (a + 1).to(torch.int32)
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)
        if lo.hidden_states is not None:  # the path's rows first: what the carry rolls in
            lo.hidden_states = self.path_rows(lo.hidden_states, path_idx, bs).reshape(bs * N, -1)
        new_state = w._carry(state, lo, a)
        if rt is not None:
            rt.finish(bs, state[..., -1], N, a, tree=True, reqs=batch.reqs,
                      learn=None if w.online is None else w.online.take_round())
        batch.forward_mode = ForwardMode.DECODE
        return GenerationBatchResult(
            logits_output=lo, next_token_ids=out.reshape(-1), accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=DLiteDraftInput(bonus_tokens=bonus, hidden_states=new_state, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=N, new_seq_lens=new_seq_lens,
        )
