"""Verify-time logits processing and acceptance for the DLITE worker.

A DLITE round verifies W = K + 1 positions per request: row j of the verify logits predicts the
token after [anchor, d_1..d_j]. For the output to be exactly what sglang produces without
speculation, every row must be processed as sglang's decode step would process it *if the
drafts d_1..d_j had already been committed*, then a token is chosen per row and the drafts are
accepted while they equal it.

Order (sglang 0.5.23's non-speculative decode: ``ModelRunner._preprocess_logits`` then
``Sampler._preprocess_logits``):
  1. additive penalties (frequency, presence, min_new_tokens),
  2. scaling penalties (repetition),
  3. the grammar vocabulary mask (a linear-chain ``GrammarTree`` over the drafts, as DFlash),
  4. ``logit_bias``,
  5. custom logit processors (``num_tokens_in_batch = W``).
(sglang's EAGLE path applies ``logit_bias`` before the grammar mask; a -inf mask and a finite
bias commute, so the two orders give the same logits.)

Penalties are exact, not sglang's "relaxed" speculative penalties: the scheduler's penalizer
orchestrator only sees the last token of each round (``eagle_prepare_for_decode`` cumulates
``output_ids[-1]``) and lags a round under overlap scheduling, so DLITE keeps its own per-request
state (``_PenaltyState`` on the ``Req``: the cumulated frequency penalty and the occurrence count
of every output token), updated on the device by the worker itself after every accept, and adds
the drafts d_1..d_j to row j. The values are accumulated the way sglang's penalizers do
(frequency: one ``scatter_add`` of the penalty per occurrence) so the logits match bit for bit.

Acceptance (``accept``): greedy rows take the argmax; sampled rows draw one token per row with
sglang's own ``Sampler`` (temperature, top-k, top-p, min-p, the per-request ``sampling_seed``
at position ``prefix_len + j``: exactly the no-speculation draw) and the longest prefix of
drafts equal to those draws is accepted, the bonus being the draw at the first mismatch. For a
deterministic draft this has the same law as rejection sampling (accept d with probability
p(d); on rejection the draw is p conditioned on != d) and it reuses every sampling rule of the
target unchanged. Acceptance therefore stops at the first draft the grammar rejects (its logit
is -inf in the row before it).

Token trees (``rounds.TreeRounds``) go through the same steps with one row per node: penalties count
the drafts on the node's root path (``parents``), the grammar mask is built over the tree
(``tree_links``), rows are sampled at position prefix_len + depth, and the longest root path whose
every token equals the choice at its parent is accepted. At most one child of a node equals that
node's draw (siblings differ), so each committed token is the target's own draw given the tokens
before it: the target's law (and a seeded request's very tokens), with the acceptance probability
of recursive rejection over one-hot siblings.

Pure torch except ``process``'s custom processors, ``grammar_tree`` / ``grammar_mask`` and
``sglang_row_sampler``: sglang is imported there only, so the rest runs (and is tested) without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from sglang_dlite.drafting.accept import greedy_accept

_STATE_ATTR = "_dlite_penalty_state"


# ---------------------------------------------------------------------- per-request penalty state
@dataclass
class _PenaltyState:
    cf: torch.Tensor  # [V] float32: frequency_penalty added once per output occurrence
    cnt: torch.Tensor  # [V] float32: occurrences of each token among the outputs
    base_len: int  # sequence length at the end of the request's last extend (min_new_tokens origin)


def _params(req):
    sp = req.sampling_params
    return (float(sp.frequency_penalty or 0.0), float(sp.presence_penalty or 0.0),
            float(sp.repetition_penalty if sp.repetition_penalty is not None else 1.0),
            int(sp.min_new_tokens or 0))


def needs_state(req) -> bool:
    f, p, r, m = _params(req)
    return f != 0.0 or p != 0.0 or r != 1.0 or m > 0


def _stop_token_ids(req) -> List[int]:
    """The token ids min_new_tokens suppresses (sglang's BatchedMinNewTokensPenalizer set)."""
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
    return sorted(i for i in ids if i is not None)


def on_extend(reqs: Sequence, next_token_ids: torch.Tensor, seq_lens: Sequence[int], vocab_size: int) -> None:
    """After a prefill / extend: (re)start the penalty state of every request that needs one from
    its freshly sampled first token. sglang's penalizers also start from zero at every prefill
    (a retracted request is re-prefilled with a new orchestrator), so this matches them."""
    device = next_token_ids.device
    for i, req in enumerate(reqs):
        if not needs_state(req):
            if getattr(req, _STATE_ATTR, None) is not None:
                setattr(req, _STATE_ATTR, None)
            continue
        f = _params(req)[0]
        tok = next_token_ids[i:i + 1].to(torch.int64)
        cnt = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        cnt.scatter_add_(0, tok, torch.ones(1, dtype=torch.float32, device=device))
        cf = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        cf.scatter_add_(0, tok, torch.full((1,), f, dtype=torch.float32, device=device))
        setattr(req, _STATE_ATTR, _PenaltyState(cf=cf, cnt=cnt, base_len=int(seq_lens[i])))


def _penalty_rows(reqs) -> List[int]:
    return [i for i, r in enumerate(reqs) if getattr(r, _STATE_ATTR, None) is not None and needs_state(r)]


def apply_scaling_penalties(logits: torch.Tensor, scale: torch.Tensor) -> None:
    """sglang's repetition-penalty rule: negative logits * s, positive logits / s (in place)."""
    logits.copy_(torch.where(logits < 0, logits * scale, logits / scale))


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, W] (node j's parent row, -1 at the root; parents before children) -> depths [B, W]."""
    depth = torch.zeros_like(parents)
    for j in range(1, parents.shape[1]):
        depth[:, j] = depth.gather(1, parents[:, j:j + 1].clamp(min=0))[:, 0] + 1
    return depth


def apply_penalties(logits3: torch.Tensor, reqs: Sequence, block: torch.Tensor, prefix_lens: torch.Tensor,
                    parents: Optional[torch.Tensor] = None) -> None:
    """Penalties on every verify row, in place. logits3 [B, W, V]; block [B, W] = [anchor, drafts].

    Row j sees the outputs committed so far (state, anchor included) plus d_1..d_j; for
    min_new_tokens it samples output number n_out + j with n_out = prefix_len - base_len + 1.
    A tree round passes ``parents`` [B, W] (row j's parent row, -1 at the root: block holds the
    tree's node tokens): row j then sees the drafts on its root path, at its depth in place of j,
    each node's accumulators its parent's plus its own token (bit-identical to the chain of that path)."""
    rows = _penalty_rows(reqs)
    if not rows:
        return
    B, W, V = logits3.shape
    device = logits3.device
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    states = [getattr(reqs[i], _STATE_ATTR) for i in rows]
    params = [_params(reqs[i]) for i in rows]
    n = len(rows)
    freq = torch.tensor([p[0] for p in params], dtype=torch.float32, device=device).view(n, 1)
    pres = torch.tensor([p[1] for p in params], dtype=torch.float32, device=device).view(n, 1)
    rep = torch.tensor([p[2] for p in params], dtype=torch.float32, device=device).view(n, 1)
    drafts = block.index_select(0, idx).to(torch.int64)  # [n, W]: anchor, d_1..d_K
    par = None if parents is None else parents.index_select(0, idx).to(torch.int64)
    banned = None
    min_new = [p[3] for p in params]
    if any(m > 0 for m in min_new):
        base = torch.tensor([s.base_len for s in states], dtype=prefix_lens.dtype, device=device)
        n_out = prefix_lens.index_select(0, idx) - base + 1  # outputs committed (anchor included)
        j = torch.arange(W, device=device, dtype=n_out.dtype)[None, :]
        j = j if par is None else tree_depths(par).to(n_out.dtype)
        mnt = torch.tensor(min_new, dtype=n_out.dtype, device=device)
        banned = (n_out[:, None] + j) < mnt[:, None]  # [n, W]
        stop = torch.zeros((n, V), dtype=torch.bool, device=device)
        for k, i in enumerate(rows):
            if min_new[k] > 0:
                ids = [t for t in _stop_token_ids(reqs[i]) if 0 <= t < V]
                if ids:
                    stop[k, torch.tensor(ids, dtype=torch.int64, device=device)] = True
    scaled = any(p[2] != 1.0 for p in params)
    zero, one = torch.zeros((), device=device), torch.ones((), device=device)
    # One [n, V] row at a time (transient memory ~5 n V floats, not n W V): row j counts d_1..d_j,
    # added one at a time as the penalizer does (bit-identical accumulators).
    cf = torch.stack([s.cf for s in states])
    cnt = torch.stack([s.cnt for s in states])
    ones = torch.ones((n, 1), dtype=torch.float32, device=device)
    if par is not None:  # a tree: every node's accumulators kept for its children ([W, n, V] each)
        ar = torch.arange(n, device=device)
        cf_at, cnt_at = cf.new_empty((W, n, V)), cnt.new_empty((W, n, V))
    for j in range(W):
        if j > 0:
            if par is not None:
                cf, cnt = cf_at[par[:, j], ar], cnt_at[par[:, j], ar]  # the parent's (copies)
            cf.scatter_add_(1, drafts[:, j:j + 1], freq)
            cnt.scatter_add_(1, drafts[:, j:j + 1], ones)
        if par is not None:
            cf_at[j], cnt_at[j] = cf, cnt
        seen = cnt > 0
        additive = torch.zeros((n, V), dtype=torch.float32, device=device)
        additive.sub_(cf)
        additive.sub_(torch.where(seen, pres, zero))
        if banned is not None:
            additive.add_(torch.where(banned[:, j:j + 1] & stop, float("-inf"), 0.0))
        row = logits3[idx, j]  # [n, V] copy
        row.add_(additive)  # float32 penalties into the logits' dtype, as sglang's in-place add
        if scaled:
            apply_scaling_penalties(row, torch.where(seen, rep, one))
        logits3[idx, j] = row


def commit(reqs: Sequence, out_tokens: torch.Tensor, accept_drafts: torch.Tensor) -> None:
    """After accept: add the committed tokens (out_tokens[b, :a_b + 1]) to the penalty state."""
    rows = _penalty_rows(reqs)
    if not rows:
        return
    device = out_tokens.device
    W = out_tokens.shape[1]
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    toks = out_tokens.index_select(0, idx).to(torch.int64)
    keep = (torch.arange(W, device=device)[None, :] <= accept_drafts.index_select(0, idx)[:, None]).float()
    freq = torch.tensor([_params(reqs[i])[0] for i in rows], dtype=torch.float32, device=device)[:, None]
    states = [getattr(reqs[i], _STATE_ATTR) for i in rows]
    cf = torch.stack([s.cf for s in states]).scatter_add_(1, toks, keep * freq)  # + 0.0 where not kept
    cnt = torch.stack([s.cnt for s in states]).scatter_add_(1, toks, keep)
    for k, s in enumerate(states):
        s.cf, s.cnt = cf[k].clone(), cnt[k].clone()


# ---------------------------------------------------------------------- the whole verify step
def process(logits: torch.Tensor, W: int, batch, block: torch.Tensor, prefix_lens: torch.Tensor,
            grammar_mask=None, parents: Optional[torch.Tensor] = None) -> None:
    """Every logits adjustment sglang's sampler makes, on all B*W verify rows, in place.
    logits: [B*W, V] (``logits_output.next_token_logits``); ``parents``: a tree round's
    (``apply_penalties``; the grammar mask was built over the same tree, ``grammar_tree``)."""
    info = batch.sampling_info
    B = logits.shape[0] // W
    logits3 = logits.view(B, W, -1)
    apply_penalties(logits3, batch.reqs, block, prefix_lens, parents)
    if grammar_mask is not None:
        grammar_mask.apply(logits)
    if info is None:
        return
    bias = getattr(info, "logit_bias", None)
    if bias is not None:
        logits3.add_(bias[:, None, :].to(logits.device))
    if getattr(info, "has_custom_logit_processor", False):  # sglang only here: the rest runs without it
        from sglang.srt.layers.sampler import apply_custom_logit_processor

        apply_custom_logit_processor(logits, info, num_tokens_in_batch=W)


def accept(drafts: torch.Tensor, logits3: torch.Tensor,
           sample_rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    """drafts [B, K], processed logits [B, W, V] -> (accepted drafts a [B], bonus [B]).

    ``sample_rows`` draws one token per row from [B*W, V] logits (None: all greedy -> argmax).
    Accepts the longest prefix of drafts equal to the per-row choice; the bonus is the choice at
    the first mismatch (or after the last draft): the speculative core's ``greedy_accept`` against
    those choices."""
    B, W = logits3.shape[:2]
    if sample_rows is None:
        target = logits3.argmax(-1)
    else:
        target = sample_rows(logits3.reshape(B * W, -1)).view(B, W).to(torch.int64)
    return greedy_accept(drafts, target)


# ---------------------------------------------------------------------- sglang glue
def is_all_greedy(info) -> bool:
    return info is None or bool(getattr(info, "is_all_greedy", True))


def expand_sampling_info(info, W: int):
    """A copy of the batch's SamplingBatchInfo with one row per verify position and nothing the
    sampler would apply a second time (penalties, bias, grammar, custom processors)."""
    rep = lambda t: None if t is None else torch.repeat_interleave(t, W, dim=0)  # noqa: E731
    return dataclasses.replace(
        info,
        temperatures=rep(info.temperatures), top_ps=rep(info.top_ps), top_ks=rep(info.top_ks),
        min_ps=rep(info.min_ps), sampling_seed=rep(info.sampling_seed),
        grammars=None, grammar_mask=None, logit_bias=None, penalizer_orchestrator=None,
        acc_additive_penalties=None, acc_scaling_penalties=None,
        has_custom_logit_processor=False, custom_params=None, custom_logit_processor=None,
        return_sampling_masks=None, return_sampling_support_logprobs=None,
        sampling_mask_batch_indices=None, sampling_support_logprobs_capture_indices=None,
        sampling_mask_top_ks=None, watermark_keys=None, watermark_context_windows=None,
        watermark_enabled=None, watermark_candidates_host=None, has_watermark_candidates=False,
    )


def sglang_row_sampler(sampler, info, W: int, prefix_lens: torch.Tensor, inplace: bool = False,
                       depths: Optional[torch.Tensor] = None):
    """sample_rows for ``accept``: sglang's own Sampler on the W rows of each request, at the
    positions a non-speculative decode would use (prefix_len + j: the input token's position;
    a tree round's rows at prefix_len + their ``depths`` [B, W]), so a per-request sampling_seed
    gives the same draws as without speculation.

    The sampler scales and softmaxes its input in place: ``inplace=True`` lets it work on the
    verify logits themselves (fine unless logprobs are read from them afterwards), otherwise
    it gets a copy (one more [B*W, V] tensor)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # sglang only here (module docstring)

    exp = expand_sampling_info(info, W)
    offsets = torch.arange(W, device=prefix_lens.device, dtype=torch.int64)[None, :] if depths is None else depths
    positions = (prefix_lens.to(torch.int64)[:, None] + offsets.to(prefix_lens.device, torch.int64)).reshape(-1)

    def sample_rows(rows: torch.Tensor) -> torch.Tensor:
        out = LogitsProcessorOutput(next_token_logits=rows if inplace else rows.clone())
        return sampler(out, exp, False, None, None, positions)

    return sample_rows


def tree_links(parents: torch.Tensor, sizes: Sequence[int]):
    """parents [B, W] (host) and each tree's real node count -> (first child, next sibling) [B, W],
    -1 where none: the links sglang's grammar traversal walks. Rows past a tree's size (padding)
    are left out of it (never visited: acceptance never takes them)."""
    B, W = parents.shape
    first, sibling = torch.full((B, W), -1, dtype=torch.int64), torch.full((B, W), -1, dtype=torch.int64)
    for b in range(B):
        last = {}
        for i in range(1, int(sizes[b])):
            p = int(parents[b, i])
            if p in last:
                sibling[b, last[p]] = i
            else:
                first[b, p] = i
            last[p] = i
    return first, sibling


def grammar_tree(batch, block: torch.Tensor, parents: Optional[torch.Tensor] = None, sizes=None):
    """The grammar tree over the verify rows (before the verify launch): the linear chain
    [anchor, d_1..d_K], or a tree round's nodes (``parents`` [B, W] and ``sizes`` on the host)."""
    if not getattr(batch, "has_grammar", False):
        return None
    from sglang.srt.speculative.spec_utils import GrammarTree  # sglang only here (module docstring)

    if parents is None:
        return GrammarTree.from_linear_chain(block)
    return GrammarTree.from_host(*tree_links(parents, sizes), block.cpu())


def grammar_mask(batch, tree, device, barrier=None):
    """Per-position vocabulary masks: row j allows what the grammar allows after d_1..d_j; rows
    after a draft the grammar rejects stay unconstrained (acceptance never reaches them)."""
    if tree is None:
        return None
    from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask  # sglang only here (module docstring)

    return build_grammar_vocab_mask(reqs=batch.reqs, tree=tree, sampling_info=batch.sampling_info,
                                    device=device, barrier=barrier)


def request_error(req) -> Optional[str]:
    """Why DLITE cannot serve this request (None: it can). Checked when the request arrives."""
    if getattr(req, "return_hidden_states", False):
        return ("return_hidden_states is not supported with --speculative-algorithm DLITE (verify "
                "rounds return no per-token hidden states); send the request to a server without "
                "speculative decoding.")
    return None
