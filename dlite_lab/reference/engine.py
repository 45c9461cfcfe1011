"""The reference speculative engine (HF transformers): the correctness oracle and CPU benchmark.

gpt-fast style, one request at a time (a batch is a loop over requests, which is exact):

    prefill(prompt)            -> target KV over the prompt, captured hidden states, first token
    loop:
        draft K tokens         (drafter reads the last captured hidden states and the anchor)
        verify K+1 tokens      (one target forward over [anchor, d_1..d_K], hidden states captured)
        accept                 (greedy: longest matching prefix; sampling: rejection sampling)
        roll back the target KV to the committed length, append the bonus token

Invariant between rounds: the target's KV covers ``tokens[:-1]``; the anchor is ``tokens[-1]``;
captured hidden states exist for positions ``< len(tokens) - 1``.
A ``Session`` keeps the target KV across the turns of a conversation (prefix reuse).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from dlite_lab.reference.drafters import DraftRequest, Drafter
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.drafting.accept import chain_rejection_sample, greedy_accept
from sglang_dlite.model.sampling import logits_to_probs
from sglang_dlite.drafting.tau import tau_of_requests
from sglang_dlite.drafting.tree import DraftTree, accept_tree


@dataclass
class RoundRecord:
    draft_tokens: list
    accepted: int  # draft tokens accepted (the bonus token is not counted here)
    context_len: int  # committed tokens before the round
    draft_ms: float
    verify_ms: float
    source: Optional[str] = None  # hybrid drafting: "suffix" | "mixed" | "dlite" | "none"
    predicted: Optional[float] = None  # the source's expected accepted drafts (hybrid/suffix)

    @property
    def committed(self) -> int:  # tau contribution: accepted + bonus
        return self.accepted + 1


@dataclass
class GenerationResult:
    prompt_len: int
    output_ids: list
    rounds: list = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    reused_prefix: int = 0  # prompt tokens whose target KV came from an earlier turn

    @property
    def tau(self) -> float:
        """τ of this request (``drafting/tau.py``: committed tokens per verify round, the prefill's
        token excluded, only the returned tokens); NaN when no verify round ran."""
        t = tau_of_requests([(len(self.output_ids), len(self.rounds))])
        return float("nan") if t is None else t


class LayerCapture:
    """Forward hooks that keep what chosen modules output, forward by forward, until taken (a
    decoder layer's output is HF's ``hidden_states[l + 1]``): the one capture of target states, used
    by this engine, gen-data's hf engine and the feature passes (``training/features.py``).
    ``dtype``: each output is stored detached in that dtype (None: as the module returned it)."""

    def __init__(self, modules: Sequence[torch.nn.Module], dtype: Optional[torch.dtype] = None):
        self.dtype = dtype
        self.outs: list = [[] for _ in modules]
        self.handles = [m.register_forward_hook(self._hook(k)) for k, m in enumerate(modules)]

    def _hook(self, k):
        def fn(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.outs[k].append(out if self.dtype is None else out.detach().to(self.dtype))
        return fn

    def take(self) -> list:
        """Per module, its outputs since the last take (one per forward, oldest first)."""
        outs, self.outs = self.outs, [[] for _ in self.outs]
        return outs

    def close(self):
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _drafter_modules(drafter, depth: int = 0):
    """The torch modules an engine drafter holds: its ``.model`` (DLite, the KV baselines), through
    a hybrid drafter's ``.dlite``. Lookup drafters hold none."""
    for name in ("model", "dlite"):
        obj = getattr(drafter, name, None)
        if isinstance(obj, torch.nn.Module):
            yield obj
        elif obj is not None and depth < 2:
            yield from _drafter_modules(obj, depth + 1)


def decoder_layers(target):
    inner = getattr(target, "model", target)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise DLiteInputError(f"{type(target).__name__} has no .model.layers: not a decoder-only causal LM.")
    return layers


class Session:
    """One conversation's target state: KV cache, committed tokens, captured hidden states."""

    def __init__(self, engine: "ReferenceEngine"):
        self.engine = engine
        self.cache = DynamicCache()
        self.tokens: list = []  # committed tokens; cache covers tokens[:-1]
        self.hidden: Optional[torch.Tensor] = None  # [L, T, H]
        self.hidden_start = 0
        self.drafter_state: dict = {}  # see DraftRequest.state

    @property
    def cache_len(self) -> int:
        return self.cache.get_seq_length()

    def _append_hidden(self, h: torch.Tensor, start: int):
        if self.hidden is None or self.hidden_start + self.hidden.shape[1] != start:
            self.hidden, self.hidden_start = h, start
        else:
            self.hidden = torch.cat([self.hidden, h], dim=1)

    def _bound_hidden(self):
        """Keep only the rows the drafter can read (its context window + allowed history).
        Called once the committed length is known (after prefill and commit): bounding while a
        verify block is appended would drop the accepted rows in favour of rejected ones."""
        keep = self.engine.hidden_rows_needed
        if keep is not None and self.hidden is not None and self.hidden.shape[1] > keep:
            cut = self.hidden.shape[1] - keep
            self.hidden = self.hidden[:, cut:].contiguous()
            self.hidden_start += cut

    def truncate(self, n: int):
        """Forget the target KV and the captured hidden states of positions >= n."""
        drop = self.cache_len - n
        if drop > 0:
            self.cache.crop(-drop)
        if self.hidden is not None:
            self.hidden = self.hidden[:, :max(0, n - self.hidden_start)]

    def forward(self, ids: list, tree: Optional[DraftTree] = None) -> torch.Tensor:
        """Run the target over ids at the end of the cache; returns logits [len(ids), V]. With a
        ``tree`` (ids = its tokens), each node sees the cache and its own root path only."""
        eng = self.engine
        start = self.cache_len
        x = torch.tensor([ids], device=eng.device)
        kw = {}
        if tree is not None:
            kw = dict(attention_mask=tree.attention_mask(start, eng.target.dtype, eng.device),
                      position_ids=tree.position_ids(start, eng.device))
        out = eng.target(input_ids=x, past_key_values=self.cache, use_cache=True, **kw)
        self.cache = out.past_key_values
        if eng.capture is not None:
            self._append_hidden(torch.stack([o[-1][0] for o in eng.capture.take()]), start)  # [L, T, H]
        return out.logits[0].float()

    def prefill(self, prompt: list) -> tuple[torch.Tensor, int]:
        """Bring the cache to cover ``prompt`` (reusing the longest common prefix with what the
        cache already holds); returns (the logits [V] of the last prompt position, how many
        leading prompt tokens were reused from the cache)."""
        if not prompt:
            raise DLiteInputError("empty prompt: give at least one token.")
        eng = self.engine
        common = len(os.path.commonprefix([self.tokens[:-1], prompt[:-1]]))
        # The drafter reads hidden states of the prompt's last `need` positions: the ones before
        # the new suffix must still be in the buffer, else re-run the target from there.
        if eng.capture is not None and common > 0:
            need = eng.hidden_rows_needed
            need_from = 0 if need is None else max(0, len(prompt) - need)
            if self.hidden is None or self.hidden_start > need_from:
                common = min(common, need_from)
        self.truncate(common)
        self.tokens = list(prompt)
        logits = self.forward(list(prompt[common:]))
        self._bound_hidden()
        return logits[-1], common

    verify = forward  # one target forward over [anchor] + drafts (a chain or a tree)

    def _keep_rows(self, base: int, rows: list):
        """Move the target KV and captured rows of verify rows ``rows`` (offsets from ``base``, in
        path order) to positions base, base+1, ..: the accepted path contiguous, rejected branches
        left past it for the crop."""
        if list(rows) == list(range(len(rows))):
            return
        idx = torch.tensor(rows, device=self.engine.device)
        for layer in self.cache.layers:
            layer.keys[..., base:base + len(rows), :] = layer.keys.index_select(-2, idx + base)
            layer.values[..., base:base + len(rows), :] = layer.values.index_select(-2, idx + base)
        h0 = base - self.hidden_start
        if self.hidden is not None and h0 >= 0:
            self.hidden[:, h0:h0 + len(rows)] = self.hidden.index_select(1, idx.to(self.hidden.device) + h0)

    def commit(self, new_tokens: list, n_valid: int, rows: Optional[list] = None):
        """After verify: keep KV/hidden of anchor + accepted drafts (n_valid rows), append tokens.
        ``rows`` (a tree): the verify rows of the accepted path, moved to the front first."""
        base = len(self.tokens) - 1
        if rows is not None:
            self._keep_rows(base, rows)
        self.truncate(base + n_valid)
        self._bound_hidden()
        self.tokens.extend(new_tokens)


class ReferenceEngine:
    """``device``: where the target runs (it is moved there); default: where its weights are. The
    drafter's modules follow the target, and every tensor the engine makes is created there."""

    def __init__(self, target, drafter: Optional[Drafter] = None, eos_token_ids: Sequence[int] = (),
                 device=None):
        if device is not None:
            target.to(device)
        self.target = target
        p = next(iter(target.parameters()), None)  # the device of the target's weights
        self.device = p.device if p is not None else torch.device("cpu")
        self.drafter = drafter
        self.eos = set(int(t) for t in eos_token_ids)
        self.max_positions = getattr(target.config, "max_position_embeddings", None)
        layers = decoder_layers(target)
        num_layers = len(layers)
        self.capture = None
        self.hidden_rows_needed = 0
        if drafter is not None:
            bad = [i for i in drafter.capture_layer_ids if not 0 <= i < num_layers]
            if bad:
                raise DLiteInputError(
                    f"the drafter wants target layers {bad}, but the target has {num_layers} layers."
                )
            if drafter.num_drafts < 1:
                raise DLiteInputError(f"a drafter proposes at least one draft per round (num_drafts="
                                      f"{drafter.num_drafts}).")
            self.capture = LayerCapture([layers[i] for i in drafter.capture_layer_ids])
            self.hidden_rows_needed = drafter.hidden_rows_needed
            for m in _drafter_modules(drafter):
                m.to(self.device)

    def close(self):
        if self.capture is not None:
            self.capture.close()

    def new_session(self) -> Session:
        return Session(self)

    def _pick(self, logits, temperature, top_p, generator):
        if temperature <= 0:
            return int(logits.argmax(-1))
        p = logits_to_probs(logits, temperature, top_p)
        return int(torch.multinomial(p, 1, generator=generator))

    @torch.no_grad()
    def generate(self, prompt: list, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: Optional[int] = None, session: Optional[Session] = None,
                 speculative: bool = True) -> GenerationResult:
        """Generate up to max_new_tokens after ``prompt`` (stops after an EOS token)."""
        if self.max_positions is not None and len(prompt) >= self.max_positions:
            raise DLiteInputError(f"the prompt has {len(prompt)} tokens, over the target's limit of "
                                  f"{self.max_positions} positions; shorten it (or truncate old turns).")
        if max_new_tokens < 1:
            raise DLiteInputError("max_new_tokens must be >= 1.")
        gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        sess = session or self.new_session()
        limit = max_new_tokens
        if self.max_positions is not None:
            limit = min(limit, self.max_positions - len(prompt))
        t0 = time.perf_counter()
        last_logits, reused = sess.prefill(list(prompt))
        first = self._pick(last_logits, temperature, top_p, gen)
        sess.tokens.append(first)
        res = GenerationResult(prompt_len=len(prompt), output_ids=[first], reused_prefix=reused)
        res.prefill_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        use_spec = speculative and self.drafter is not None
        new = [first]
        while len(res.output_ids) < limit and self.eos.isdisjoint(new):  # until the first EOS committed
            if use_spec:
                new = self._round(sess, res, temperature, top_p, gen)
            else:
                new = [self._pick(sess.forward([sess.tokens[-1]])[-1], temperature, top_p, gen)]
                sess.tokens.extend(new)
                res.output_ids.extend(new)
        res.decode_ms = (time.perf_counter() - t1) * 1e3
        # Truncate at the first EOS / the limit (a round may have committed past them).
        out = res.output_ids
        end = next((i + 1 for i, t in enumerate(out) if t in self.eos), len(out))
        res.output_ids = out[:min(end, limit)]
        if len(sess.tokens) > len(prompt) + len(res.output_ids):  # keep the session consistent with the output
            sess.tokens = sess.tokens[:len(prompt) + len(res.output_ids)]
            sess.truncate(len(sess.tokens) - 1)
        finish = getattr(self.drafter, "finish_request", None) if use_spec else None
        if finish is not None:  # a lookup drafter frees the request (its corpus, if on, keeps the tokens)
            finish(sess.drafter_state, list(sess.tokens))
        return res

    def generate_batch(self, prompts: Sequence[list], max_new_tokens: int, **kw) -> list:
        """A batch is a loop over requests: exact, each request with its own session (the
        reference engine is the oracle, not the fast path; sglang batches for real)."""
        seed = kw.pop("seed", None)
        return [self.generate(list(p), max_new_tokens, seed=None if seed is None else seed + i, **kw)
                for i, p in enumerate(prompts)]

    def _round(self, sess: Session, res: GenerationResult, temperature, top_p, gen) -> list:
        """One draft + verify round; returns the tokens it committed (an EOS among them may be
        followed by more, cut by ``generate``)."""
        ctx_len = len(sess.tokens)
        t0 = time.perf_counter()
        req = DraftRequest(
            tokens=sess.tokens, hidden=sess.hidden, hidden_start=sess.hidden_start,
            temperature=temperature, top_p=top_p, generator=gen, state=sess.drafter_state,
        )
        prop = self.drafter.draft(req)
        tree = getattr(prop, "tree", None)
        drafts = tree.drafts if tree is not None else [int(t) for t in prop.tokens[0].tolist()]
        t1 = time.perf_counter()
        # [K+1, V]; a lookup chain may be shorter than the block (then a shorter verify)
        logits = sess.verify([sess.tokens[-1]] + drafts, tree=tree)
        t2 = time.perf_counter()
        rows = None
        if tree is not None:  # drafting/tree.py: the accepted root path = its verify rows
            p = None if temperature <= 0 else logits_to_probs(logits, temperature, top_p)
            rows, new = accept_tree(tree, logits.argmax(-1), p=p, generator=gen)
            a = len(rows) - 1
        elif temperature <= 0:
            a, new = accept_round(drafts, logits.argmax(-1))
        else:
            q = prop.probs[0].to(logits.device) if prop.probs is not None else None
            a, new = accept_round(drafts, p=logits_to_probs(logits, temperature, top_p), q=q, generator=gen)
        sess.commit(new, a + 1, rows)
        commit = getattr(self.drafter, "commit", None)  # a lookup drafter's index takes the accepted drafts
        if commit is not None:
            commit(req, new[:-1])
        observe = getattr(self.drafter, "observe", None)  # a drafter learning from verify results (online.py)
        if observe is not None and tree is None:
            observe(req, drafts, logits, a)
        elif observe is not None:  # a tree: its accepted root path, a chain the target verified row by row
            observe(req, [tree.tokens[r] for r in rows[1:]], logits[rows], a, path=True, committed=new)
        res.output_ids.extend(new)
        res.rounds.append(RoundRecord(drafts, a, ctx_len, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                                      getattr(prop, "source", None), getattr(prop, "score", None)))
        return new


def accept_round(drafts: list, target_tokens: Optional[torch.Tensor] = None, *, p: Optional[torch.Tensor] = None,
                 q: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None):
    """What one verify round of a chain commits: (accepted drafts ``a``, ``drafts[:a] + [bonus]``).

    Greedy: ``target_tokens`` [K+1], the target's token at each verify row (``greedy_accept``);
    sampled: ``p`` [K+1, V] the target's filtered distributions and ``q`` as in ``rejection_sample``.
    The reference engine's round and gen-data's fast engine (``training/fast_regen.py``) accept
    through it."""
    if p is not None:
        a, bonus = rejection_sample(p, q, drafts, generator)
    elif not drafts:  # nothing to verify: the target's own next token
        a, bonus = 0, int(target_tokens[0])
    else:
        d = torch.tensor([list(drafts)], dtype=torch.int64, device=target_tokens.device)
        acc, bon = greedy_accept(d, target_tokens[None])
        a, bonus = int(acc[0]), int(bon[0])
    return a, list(drafts[:a]) + [bonus]


def rejection_sample(p: torch.Tensor, q: Optional[torch.Tensor], drafts: list,
                     generator: Optional[torch.Generator] = None):
    """Standard speculative rejection sampling along one request's chain (the speculative core's
    ``chain_rejection_sample`` for a batch of one).

    p: [K+1, V] target distributions (row j scores the token after anchor+drafts[:j]);
    q: [K, V] the distributions the drafts were sampled from (None: deterministic drafts, i.e.
    one-hot q). Returns (accepted count a, the token that follows the accepted drafts).
    """
    d = torch.tensor([list(drafts)], dtype=torch.int64, device=p.device)
    a, bonus = chain_rejection_sample(p[None], d, None if q is None else q[None], generator=generator)
    return int(a[0]), int(bonus[0])
