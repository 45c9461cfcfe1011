"""The two kinds of DLITE decode round, one interface: ``ChainRounds`` and ``TreeRounds``.

The worker's one round body (``worker.DLiteWorker._forward_decode``) asks a kind to ``draft`` a
``Round`` (what each request verifies: rows, positions, attention mask), runs the one TARGET_VERIFY
forward itself, then asks the kind to ``accept`` (the target's choice per row -> accepted drafts,
bonus, the committed tokens), ``learn`` (online learning), ``commit`` (KV, the lookup, the penalty
state) and for the verify rows to carry (``carried_rows``); the worker carries the last C of them.

**Chains** (``ChainRounds``, every round a tree round does not take): per request [anchor,
d_1..d_n] (n + 1 <= W), written to the W KV slots the scheduler reserved, causal. With hybrid
drafting (the default) the chain is the suffix lookup's, DLite's, or DLite's prefix continued by
the lookup (``drafting.hybrid.BatchLookup``), cut on a CPU to the width that pays; DLite alone
otherwise. Accept: every sglang logits adjustment on the W rows, then the longest prefix equal to
the target's per-row choice (``verify_logits.accept``). Rejected slots need no cleanup: the next
round overwrites them.

**Token trees** (``TreeRounds``):

Per request the round grows a tree (``drafting.hybrid.grow_trees``) from the suffix
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
  carry  : the path's captured rows first: they become DLite's context (``carried_rows``).

With online learning (``online_serving.py``) the trees come from the learner's adapted copy, or from
the shipped drafter while the tree gate says the adapted trees lose (``OnlineServing.tree_gate``: one
round in ``watch_every`` grows both and judges the one not verified against what the round committed).

Which rounds: ``TreeRounds.wanted`` -- batches of at most ``tree_max_batch_size`` requests with
drafts, no logprobs and no opt-out, greedy or sampled, with any penalty, grammar, logit_bias or
custom processor; every other round is a chain (``ChainRounds``), so what a tree round
does not handle is never served by it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from sglang_dlite.drafting.chooser import default_calibration
from sglang_dlite.drafting.hybrid import grow_trees
from sglang_dlite.drafting.tree import DraftTree, greedy_tree_accept
from sglang_dlite.serving import metrics as dlite_metrics
from sglang_dlite.serving import verify_logits
from sglang_dlite.serving.info import unpack_context


@dataclass
class Round:
    """One decode round's drafts as the worker verifies them, and what its kind keeps until commit."""

    tokens: torch.Tensor  # [B, W] the rows each request verifies: [anchor, drafts] or a tree's nodes
    drafted: bool = True  # the round has drafts (False: the anchors alone, plain decoding)
    positions: Optional[torch.Tensor] = None  # [B * W] (trees: prefix + depth; None: consecutive)
    mask: Optional[torch.Tensor] = None  # the tree's attention mask (None: causal)
    grammar: object = None  # verify_logits.grammar_tree, started on the host before the verify
    tree: bool = False
    trees: List[DraftTree] = field(default_factory=list)  # trees: per request
    layout: tuple = ()  # trees: (tokens, depths, parents) on the device
    idxs: list = field(default_factory=list)  # trees: the lookup's indices (begin_round)
    sources: list = field(default_factory=list)  # which source grew each tree / drafted each chain (the lookup's)
    judge: Optional[tuple] = None  # trees: a judged round of the online tree gate (others, adapted verified?)
    path_idx: Optional[torch.Tensor] = None  # trees: [B, N] the accepted path's node per committed token
    paths: list = field(default_factory=list)  # trees: the accepted drafts per request


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


class ChainRounds:
    """A chain per request (module docstring); ``worker`` is the ``DLiteWorker`` (its public state)."""

    def __init__(self, worker):
        self.w = worker

    def draft(self, batch, state: torch.Tensor, anchors: torch.Tensor, n: int) -> Round:
        """[anchor, <= n drafts] per request; n = 0 (``budget.LoadPolicy``, the draft gate): none, no
        drafter pass, the lookup only takes the anchors. Under TP every rank verifies rank 0's block."""
        drafts = self._drafts(batch, state, anchors, n).to(torch.int64)
        drafts = self.w.tp_same(drafts, "drafts")
        block = torch.cat([anchors[:, None], drafts], dim=1)
        return Round(block, drafted=n > 0, grammar=verify_logits.grammar_tree(batch, block))

    def _drafts(self, batch, state, anchors, n: int) -> torch.Tensor:
        w = self.w
        seq = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else None
        if n == 0:
            if w.lookup is not None:
                w.lookup.skip_round(batch.reqs, anchors.tolist(), seq)
            return anchors.new_empty((len(anchors), 0))
        if w.lookup is None:
            return self.dlite(state, anchors)[:, :n]

        def dlite():  # the hybrid asks DLite only where some request's lookup is not confident enough
            d, conf = self.dlite(state, anchors, with_confidence=True)
            return d.tolist(), conf.float().tolist()

        width = None if w.width_policy is None else w.width_policy.choose_expected
        drafts, _, _ = w.lookup.draft_round(batch.reqs, anchors.tolist(), seq, dlite, width)
        return torch.tensor(drafts, dtype=torch.int64, device=w.device).view(len(drafts), -1)[:, :n]

    def dlite(self, state: torch.Tensor, anchors: torch.Tensor, with_confidence: bool = False):
        """DLite's chain [B, dlite_drafts] (and its confidence): the drafter's CUDA graph where captured."""
        w = self.w
        ctx, valid = unpack_context(state, w.L, w.H)
        anchors = anchors.to(torch.int64)
        if w.graphs is not None and w.graphs.with_confidence == with_confidence:
            out = w.graphs.propose(ctx, valid, anchors)
            if out is not None:
                return (out[0].clone(), out[1].clone()) if with_confidence else out.clone()
        prop = w.drafter.propose(ctx.contiguous(), valid, anchors, num_drafts=w.dlite_drafts,
                                 return_confidence=with_confidence)
        return (prop.tokens, prop.confidence) if with_confidence else prop.tokens

    def accept(self, rd: Round, batch, prefix_lens, logits_output, grammar_barrier, opt_out):
        """Every sglang logits adjustment on the W rows (``verify_logits.process``), then (accepted
        drafts a [B], bonus [B], the committed tokens [B, W]: accepted drafts, the bonus at row a):
        argmax, or sglang's own sampler per row (``verify_logits.accept``). Rows of ``opt_out``
        accept nothing (their drafts are padding): the bonus is row 0's pick."""
        w, block = self.w, rd.tokens
        bs, W = block.shape
        logits = logits_output.next_token_logits.view(bs, W, -1)
        gmask = verify_logits.grammar_mask(batch, rd.grammar, logits.device, grammar_barrier)
        verify_logits.process(logits_output.next_token_logits, W, batch, block, prefix_lens, gmask)
        info = batch.sampling_info
        sample_rows = None
        if not verify_logits.is_all_greedy(info):
            sample_rows = verify_logits.sglang_row_sampler(w.model_runner.sampler, info, W, prefix_lens,  # online
                                                           inplace=not batch.return_logprob and w.online is None)
        drafts = block[:, 1:] if opt_out is None else block[:, 1:].masked_fill(opt_out[:, None], -1)
        a, bonus = verify_logits.accept(drafts, logits, sample_rows)
        if w.tp is not None:  # TP: the same accept lengths and bonus tokens on every rank
            ab = w.tp_same(torch.stack([a.to(torch.int64), bonus.to(torch.int64)]), "accept lengths / bonus tokens")
            a, bonus = ab[0].to(a.dtype), ab[1].to(bonus.dtype)
        out = torch.zeros((bs, W), dtype=torch.int64, device=w.device)
        out[:, :W - 1] = block[:, 1:]
        out.scatter_(1, a[:, None], bonus[:, None])
        return a, bonus, out

    def learn(self, rd: Round, state, anchors, logits_output, a, out, opt_out) -> None:
        bs, W = rd.tokens.shape
        self.w.online.observe(state, anchors, rd.tokens, logits_output.next_token_logits.view(bs, W, -1), a, opt_out)

    def commit(self, rd: Round, batch, a: torch.Tensor, out: torch.Tensor) -> None:
        """The lookup and the penalty state take the committed tokens (the KV is in place: a chain's
        accepted rows are the first a + 1 slots)."""
        w = self.w
        sources = None if w.lookup is None else w.lookup.commit_round(batch.reqs, a.tolist())
        if sources is not None:  # /metrics: rounds drafted by each source; the per-response metrics
            dlite_metrics.record_sources(sources)
            rd.sources = sources
        verify_logits.commit(batch.reqs, out, a)

    @staticmethod
    def carried_rows(rd: Round, logits_output) -> None:
        pass  # a chain's rows 0..a are its first rows already


class TreeRounds:
    """The worker's tree rounds (module docstring); ``worker`` is the ``DLiteWorker`` (its public state)."""

    def __init__(self, worker, max_batch_size: int, branches: int = 4):
        self.w = worker
        self.max_batch_size = int(max_batch_size)
        self.branches = int(branches)
        self.rows = int(worker.W)  # tree nodes + the root, per request, at most (the reserved KV slots)
        self.cal = worker.lookup.cal if worker.lookup is not None else default_calibration()

    def wanted(self, batch, bs: int, n: int, opt_out) -> bool:
        """Whether this round is a tree round (module docstring)."""
        return n > 0 and opt_out is None and bs <= self.max_batch_size and not batch.return_logprob

    def grow(self, batch, state: torch.Tensor, anchors: torch.Tensor) -> Round:
        """One tree per request: the lookup's continuations + DLite's top-k along its chain, cut on a
        CPU to the rows that pay (``Round.trees``; ``Round.judge``: the tree gate's other trees)."""
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
        trees, reaches, sources = self._grow(w.drafter if adapted else w.online.shipped, idxs, ctx, valid,
                                             anchors, anchor_list)
        rows = self.rows
        if w.width_policy is not None:  # a CPU: as many rows as pay, from the verify width's cost model
            rows = w.width_policy.choose_expected(expected_by_rows(reaches))
            trees = [first_nodes(t, rows) for t in trees]
        rows = max(len(t) for t in trees)  # no round pads every tree
        judge = None
        if gate is not None and gate[1]:  # judged: the other model's trees, cut to this round's rows
            others, _, _ = self._grow(w.online.shipped if adapted else w.drafter, idxs, ctx, valid, anchors,
                                      anchor_list)
            judge = ([first_nodes(t, rows) for t in others], adapted)
        return Round(anchors.new_empty((len(trees), 0)), tree=True, trees=trees, idxs=idxs, sources=sources,
                     judge=judge)

    def _grow(self, model, idxs, ctx, valid, anchors, anchor_list):
        """Per request a tree from ``model``'s top-k along its chain and the lookup -> (trees, reaches, sources)."""
        w = self.w
        prop = model.propose(ctx, valid, anchors, num_drafts=w.dlite_drafts, top_k=self.branches)
        return grow_trees(anchor_list, idxs, prop.top_tokens.tolist(), prop.top_probs.float().tolist(), self.cal,
                          self.branches, self.rows - 1)

    def draft(self, batch, state: torch.Tensor, anchors: torch.Tensor, n: int) -> Round:
        """The round's trees, padded to its rows, on the device: the nodes at positions prefix +
        depth under the tree's mask; the grammar tree (host) started before the verify."""
        w = self.w
        rd = self.grow(batch, state, anchors)
        tokens, depths, anc, parents = tree_arrays(rd.trees, max(len(t) for t in rd.trees))
        device = w.device
        rd.layout = (tokens.to(device), depths.to(device), parents.to(device))
        rd.tokens = rd.layout[0]
        rd.grammar = verify_logits.grammar_tree(batch, tokens, parents, [len(t) for t in rd.trees])
        prefix_lens = batch.seq_lens
        host_prefix = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else prefix_lens.cpu()).tolist()
        rd.positions = (prefix_lens[:, None].to(torch.int64) + rd.layout[1]).reshape(-1)
        rd.mask = verify_mask(anc, host_prefix, device, draft_only=str(device).startswith("cpu"))
        return rd

    def choices(self, rd: Round, batch, prefix_lens: torch.Tensor, logits_output, grammar_barrier=None) -> torch.Tensor:
        """Every sglang logits adjustment on every node's row, in place, then the target's choice
        per node [B, N] (host): argmax, or sglang's sampler at position prefix + depth."""
        w = self.w
        logits = logits_output.next_token_logits
        tokens, depths, parents = rd.layout
        gmask = verify_logits.grammar_mask(batch, rd.grammar, logits.device, grammar_barrier)
        N = tokens.shape[1]
        verify_logits.process(logits, N, batch, tokens, prefix_lens, gmask, parents=parents)
        info = batch.sampling_info
        if verify_logits.is_all_greedy(info):
            return logits.view(-1, N, logits.shape[-1]).argmax(-1).cpu()
        sample = verify_logits.sglang_row_sampler(w.model_runner.sampler, info, N, prefix_lens,
                                                  inplace=w.online is None, depths=depths)  # online reads logits
        return sample(logits).view(-1, N).cpu()

    def accept(self, rd: Round, batch, prefix_lens, logits_output, grammar_barrier=None, opt_out=None):
        """Tree acceptance per request against the target's choice per node -> (accepted drafts a [B],
        bonus [B], the committed tokens [B, N]; on the device); ``rd.path_idx`` [B, N]: the path's node
        index per committed token (-1 past it)."""
        target = self.choices(rd, batch, prefix_lens, logits_output, grammar_barrier)
        B, N = rd.tokens.shape
        a, bonus = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        path_idx = torch.full((B, N), -1, dtype=torch.int64)
        out = torch.zeros(B, N, dtype=torch.int64)
        for b, tree in enumerate(rd.trees):
            path, bon = greedy_tree_accept(tree, target[b, :len(tree)])
            committed = tree.committed(path, bon)
            a[b], bonus[b] = len(path) - 1, bon
            path_idx[b, :len(path)] = torch.tensor(path)
            out[b, :len(committed)] = torch.tensor(committed)
            rd.paths.append(committed[:-1])
        rd.path_idx = path_idx
        dev = self.w.device
        return a.to(dev), bonus.to(dev), out.to(dev)

    def learn(self, rd: Round, state, anchors, logits_output, a, out, opt_out=None) -> None:
        """Online learning from the accepted path; the tree gate's judged round scored."""
        w = self.w
        bs, N = rd.tokens.shape
        a, out = a.cpu(), out.cpu()
        w.online.observe_tree(state, anchors, out, rd.path_idx, a, logits_output.next_token_logits.view(bs, N, -1))
        if rd.judge is not None:  # the tree gate's judged round: the other trees against what was committed
            w.online.judge_trees(*rd.judge, out, a)

    def commit(self, rd: Round, batch, a: torch.Tensor, out: torch.Tensor) -> None:
        """The path's KV to the slots after each prefix; the lookup takes the accepted drafts; the
        penalty state the committed tokens."""
        w = self.w
        B, N = rd.path_idx.shape
        flat = torch.where(rd.path_idx >= 0, rd.path_idx + N * torch.arange(B)[:, None], -1)  # rows of the B*N verify
        move_accept_tokens_to_target_kvcache(batch, flat.to(torch.int32).to(w.device), a,
                                             w.model_runner.token_to_kv_pool_allocator)
        if w.lookup is not None:
            w.lookup.commit(batch.reqs, rd.idxs, rd.paths, a.tolist(), rd.sources)
        dlite_metrics.record_sources(rd.sources)
        verify_logits.commit(batch.reqs, out, a)

    @staticmethod
    def carried_rows(rd: Round, logits_output) -> None:
        """The captured verify rows, the accepted path's first (what the worker's carry rolls in)."""
        hidden = logits_output.hidden_states
        if hidden is None:
            return
        B, N = rd.path_idx.shape
        hv = hidden.view(B, -1, hidden.shape[-1])
        idx = rd.path_idx.clamp(min=0).to(hv.device)
        logits_output.hidden_states = hv.gather(1, idx[:, :, None].expand(-1, -1, hv.shape[-1])).reshape(B * N, -1)
