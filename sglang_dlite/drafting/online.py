"""Online adaptation: DLite learns from the verify results of the traffic it serves.

Every verify round holds the drafter's training signal, in distribution and for free: the inputs
DLite read (the last C captured target rows and the anchor) and the target's own logits at every
verified row. ``OnlineLearner`` keeps those pairs in a bounded buffer and, every ``update_every``
rounds, takes a few optimizer steps on a small parameter set of a *working copy* of the drafter,
with the stabilize stage's loss (CE + TV against the target, ``losses.py``).

One pair per round, for a chain ``d_1..d_n`` verified after anchor ``t``::

    row j of the verify logits scores the token after t, d_1..d_j   (j = 0..n)
    the drafter's position j (0-based) is fed d_j (the head's token feedback) and predicts row j's
    label; rows 0..a (a = accepted drafts) are conditioned on committed tokens only: those are
    the pair's valid positions (the same teacher forcing as offline training).

The pair does not depend on who drafted (lookup drafts teach DLite too); a token tree's round
teaches the chain of its accepted root path. Parameter sets: ``online_config.PARAM_SETS``. Scopes:
``session`` (state in the session's ``drafter_state``, from the shipped weights with each
conversation) and ``server`` (one state, decayed back towards the shipped weights after every
update: ``serving/online_serving.py``). Rails: the shipped model is never written; a watchdog
compares the adapted chain's acceptance with the shipped drafter's on the same rounds (one in
``watch_every``) and reverts when a window says it is worse; under token trees a tree gate drafts the
adapted or the shipped tree, whichever would have accepted more over the last ``tree_gate`` judged
rounds (``tree_gate``), and while the shipped tree is drafted one tree round in ``backoff`` is
learned; a seed makes every update deterministic (``max_update_ms`` is the one source of run-to-run
variation). What each setting measured: ``docs/results.md`` (online adaptation).
"""

from __future__ import annotations

import copy
import math
import time
import weakref
from collections import deque
from dataclasses import fields
from typing import NamedTuple, Optional

import torch

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.losses import position_weights, tv_distance, weighted_ce
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.online_config import PARAM_SETS, OnlineConfig

STATE_KEY = "online"  # this module's entry in a session's drafter_state


class Pair(NamedTuple):
    """One verify round as a training example (drafting-vocabulary indices; -1: not in it / none)."""

    context: torch.Tensor  # [L, C, H] the captured rows the drafter read
    valid: torch.Tensor  # [C] bool
    anchor: int
    feedback: torch.Tensor  # [K] the verified drafts (the head's token feedback), 0-padded
    labels: torch.Tensor  # [K] the target's argmax per row; -1 past the first rejection
    top_idx: torch.Tensor  # [K, k] the target's top-k tokens per row
    top_p: torch.Tensor  # [K, k] their probabilities

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if isinstance(t, torch.Tensor))


class _State:
    """One scope's adaptation: its parameter values, optimizer, buffer, watchdog window."""

    def __init__(self, learner: "OnlineLearner"):
        self.values = {n: v.clone() for n, v in learner.shipped_values.items()}
        self.optim = torch.optim.Adam(learner.masters, lr=learner.cfg.lr)
        self.buffer: deque = deque(maxlen=learner.cfg.buffer_size)
        self.window: deque = deque(maxlen=max(1, learner.cfg.watchdog_window))  # (adapted, shipped) accepted
        self.gate: deque = deque(maxlen=max(1, learner.cfg.tree_gate))  # +1 / -1 / 0: adapted tree better / worse / tied
        self.rounds = self.rounds_since_update = 0  # rounds seen (the watchdog: one in watch_every)
        self.held = 0  # tree rounds the gate held on the shipped tree since it last drafted the adapted one (backoff)
        self.gate_rounds = 0  # tree rounds drafted under the gate (one in watch_every judged)
        self.update_period = learner.cfg.update_every  # rounds until the next update (paced: more)
        self.adapted = False  # values differ from the shipped ones


def chain_accepted(chain: list, drafts: list, target_tokens: list) -> int:
    """How many of ``chain`` the target accepts, judged from one verify of ``drafts``: row j of
    ``target_tokens`` is only valid for a chain that agrees with ``drafts[:j]``, so past the first
    disagreement this is a lower bound (exact for ``chain == drafts``)."""
    for i, tok in enumerate(chain):
        if i >= len(target_tokens) or tok != target_tokens[i]:
            return i
        if i >= len(drafts) or tok != drafts[i]:
            return i + 1  # accepted here; the rows after it judged another chain
    return len(chain)


def working_copy(model: DLiteDrafter) -> DLiteDrafter:
    """A deep copy of the drafter that shares (does not copy) the target's frozen tensors."""
    frozen = (model.embed_weight, model.lm_head_weight, model.draft_head_weight)
    memo = {id(t): t for t in frozen}
    memo.update({id(v): v for v in vars(model).values() if isinstance(v, torch.Tensor)})
    for m in model.modules():  # ops.pack_cpu_linears' packed copies (opaque: not copyable): the copy repacks
        for attr in ("_dlite_packed", "_dlite_packed_key"):
            if getattr(m, attr, None) is not None:
                memo[id(getattr(m, attr))] = None
    return copy.deepcopy(model, memo)


def trainable_names(model: DLiteDrafter, params: str) -> list:
    last = len(model.layers) - 1
    prefixes = [p.replace("layers.-1.", f"layers.{last}.") for p in PARAM_SETS[params]]
    return [n for n, _ in model.named_parameters() if n.startswith(tuple(prefixes))]


class OnlineLearner:
    """Learns a working copy of ``shipped`` (never written) from verify rounds; see the module doc."""

    def __init__(self, shipped: DLiteDrafter, cfg: Optional[OnlineConfig] = None, drafts_are_model: bool = False):
        """``drafts_are_model``: the verified chains are the working model's own greedy chain (DLite
        alone: the watchdog compares against them instead of drafting them again)."""
        self.cfg = cfg = cfg or OnlineConfig()
        mc = shipped.config
        if mc.history_window != 0 or mc.head_input != "token":
            raise DLiteConfigError("online adaptation needs the shipped DLite layout (history none, token-fed "
                                   f"head); this drafter has history={mc.history!r}, head_input={mc.head_input!r}.")
        self.shipped = shipped
        self.model = working_copy(shipped).eval()
        names = trainable_names(self.model, cfg.params)
        params = dict(self.model.named_parameters())
        for n, p in params.items():
            p.requires_grad_(n in names)
        self.trainable = [params[n] for n in names]
        self.names = names
        # what the optimizer steps: the parameters themselves in float32, else float32 master copies
        # (a bf16 drafter: Adam's small steps would round away), written back after every change
        self.masters = [p if p.dtype == torch.float32 else p.detach().float() for p in self.trainable]
        self.shipped_values = {n: m.detach().clone() for n, m in zip(names, self.masters)}
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.weights = position_weights(mc.block_size, cfg.gamma)
        self._vocab_index = self._build_vocab_index()
        self._server = _State(self) if cfg.scope == "server" else None
        self._active = None  # weakref to the state whose values the working model holds
        self.drafts_are_model = drafts_are_model
        # the chain watchdog judges tree rounds' accepted paths too, unless the tree gate judges them
        self.watch_paths = not cfg.tree_gate
        self.stats = {"rounds": 0, "updates": 0, "steps": 0, "reverts": 0, "budget_cut": 0, "backed_off": 0,
                      "observe_ms": 0.0, "update_ms": 0.0, "shadow_ms": 0.0, "sessions": 0, "watched": 0,
                      "gate_adapted": 0, "gate_shipped": 0, "gate_better": 0, "gate_worse": 0}

    # ------------------------------------------------------------------ bookkeeping
    def _build_vocab_index(self) -> torch.Tensor:
        """Token id -> index in the drafting vocabulary (-1: not in it); identity without one."""
        V, m = self.model.config.vocab_size, self.model
        if not m.config.draft_vocab_size:
            return torch.arange(V)
        idx = torch.full((V,), -1, dtype=torch.int64)
        idx[m.draft_vocab.cpu()] = torch.arange(m.draft_vocab.numel())
        return idx

    def describe(self) -> str:
        n = sum(v.numel() for v in self.shipped_values.values())
        K, C, L = self.model.config.block_size, self.model.config.num_context_positions, self.model.config.num_capture_layers
        pair = (L * C * self.model.config.target_hidden_size + C) * 4 + K * (3 + 2 * self.cfg.tv_topk) * 8
        return (f"online adaptation: params={self.cfg.params} ({n:,} trainable values, "
                f"{n * 4 * 3 / 2**20:.1f} MiB with Adam per state), scope={self.cfg.scope}, lr={self.cfg.lr}, "
                f"update every {self.cfg.update_every} rounds x {self.cfg.steps} steps of {self.cfg.batch_size} "
                f"pairs, buffer {self.cfg.buffer_size} pairs (~{pair * self.cfg.buffer_size / 2**20:.1f} MiB), "
                f"watchdog window {self.cfg.watchdog_window}, seed {self.cfg.seed}"
                + (f", tree gate {self.cfg.tree_gate}" if self.cfg.tree_gate else "")
                + (f", back-off 1/{self.cfg.backoff} while the gate holds the shipped tree"
                   if self.cfg.tree_gate and self.cfg.backoff > 1 else ""))

    def state_for(self, session: Optional[dict]) -> _State:
        """The adaptation state of a conversation (``session``: its scratch dict, which keeps the
        state under ``STATE_KEY``), or the server's one state at server scope (``session`` unused)."""
        if self._server is not None:
            return self._server
        st = session.get(STATE_KEY)
        if st is None:  # a new conversation: the shipped weights, an empty buffer
            st = session[STATE_KEY] = _State(self)
            self.stats["sessions"] += 1
        return st

    @torch.no_grad()
    def activate(self, st: _State) -> None:
        """Load ``st``'s values into the working model (one request at a time shares it)."""
        if self._active is not None and self._active() is st:
            return
        for m, n in zip(self.masters, self.names):
            m.copy_(st.values[n])
        self._sync_masters()
        self._active = weakref.ref(st)

    @torch.no_grad()
    def _sync_masters(self) -> None:
        """The float32 masters' values into the drafter's own (lower-precision) parameters."""
        for p, m in zip(self.trainable, self.masters):
            if m is not p:
                p.copy_(m)

    @torch.no_grad()
    def _save(self, st: _State) -> None:
        for m, n in zip(self.masters, self.names):
            st.values[n].copy_(m)

    @torch.no_grad()
    def revert(self, st: _State) -> None:
        """Back to the shipped weights (fresh optimizer moments; the buffer is kept)."""
        for n, v in st.values.items():
            v.copy_(self.shipped_values[n])
        st.optim = torch.optim.Adam(self.masters, lr=self.cfg.lr)
        st.window.clear()
        st.gate.clear()
        st.adapted = False
        self._active = None
        self.activate(st)

    # ------------------------------------------------------------------ the tree gate
    def tree_gate(self, st: _State, requests: int = 1) -> Optional[tuple]:
        """A tree round's gate over its ``requests`` trees, the one rule of both engines: None (off, or
        ``st`` not adapted yet: the working copy drafts) or (draft with the adapted copy?, judge this
        round? -- one round in ``watch_every`` also grows the other tree, and ``judge_tree`` scores it
        against what the round committed)."""
        if not (self.cfg.tree_gate and st.adapted):
            return None
        st.gate_rounds += 1
        return self.gate_choice(st, requests), st.gate_rounds % self.cfg.watch_every == 0

    @staticmethod
    def gate_favours_adapted(st: _State) -> bool:
        """The tree gate's rule: over the last ``tree_gate`` judged rounds the adapted tree would have
        accepted more than the shipped tree more often than fewer (an empty record: no)."""
        return sum(st.gate) > 0

    def gate_choice(self, st: _State, requests: int = 1) -> bool:
        """The tree gate's choice for a round of ``requests`` trees (``tree_gate``), counted in the stats."""
        use = self.gate_favours_adapted(st)
        self.stats["gate_adapted" if use else "gate_shipped"] += requests
        return use

    def learns_tree_round(self, st: _State) -> bool:
        """The learning back-off (``backoff``), asked once per tree round before its learning: while the
        tree gate drafts the shipped tree (the working copy adapted, its record not in favour), learn from
        one tree round in ``backoff``: the pairs, and with them the updates, fall to 1 / ``backoff`` of the
        full rate, and the learning's cost with them, where the adapted drafts are not being used; the
        gate goes on judging (its verdicts bring the full rate back the round the record turns in favour)."""
        if self.cfg.backoff <= 1 or not self.cfg.tree_gate or not st.adapted or self.gate_favours_adapted(st):
            st.held = 0
            return True
        st.held += 1
        if st.held % self.cfg.backoff == 1:  # the first held round learns, then one in backoff
            return True
        self.stats["backed_off"] += 1
        return False

    def judge_tree(self, st: _State, verified_adapted: bool, other, committed: list, accepted: int) -> int:
        """One judged tree round into ``st``'s gate: ``other`` the tree not verified (a ``DraftTree``),
        ``committed`` what the round committed (the accepted path's drafts + the bonus), ``accepted``
        the verified tree's accepted drafts. Returns the verdict from the adapted tree's side: +1 better,
        -1 worse, 0 tied (``DraftTree.accepted_along``: exact for greedy rounds)."""
        n = other.accepted_along(committed)
        sign = (n > accepted) - (n < accepted)  # the tree not verified: better / worse
        better = -sign if verified_adapted else sign
        st.gate.append(better)
        if better:
            self.stats["gate_better" if better > 0 else "gate_worse"] += 1
        return better

    # ------------------------------------------------------------------ the round
    def learn_round(self, st: _State, ctx, valid, anchors, drafts, probs, accepted, path: bool = False) -> None:
        """One verify round of B requests into ``st``: its pairs into the buffer, the watchdog's
        comparison (once adapted, one round in ``watch_every``), an update when one is due. ``ctx``
        [B, L, C, H] / ``valid`` [B, C] the rows the drafter read, ``anchors`` [B], ``drafts`` [B, n]
        the verified chain, ``probs`` [B, n + 1, V] the target's distribution per verified row,
        ``accepted`` [B]. ``path``: a tree round's accepted root path (the watchdog cuts row b at
        ``accepted[b]``: the rest was not verified as a chain; never the working model's chain)."""
        accepted = torch.as_tensor(accepted, dtype=torch.int64).cpu()
        st.buffer.extend(self.make_pairs(ctx, valid, anchors, drafts, probs, accepted))
        st.rounds += 1
        watch = not (path and not self.watch_paths) and st.adapted and self.cfg.watchdog_window \
            and st.rounds % self.cfg.watch_every == 0 and drafts.shape[1]
        if watch:
            d, t, a = drafts.tolist(), probs.argmax(-1).tolist(), accepted.tolist()
            d, t = ([r[:n] for r, n in zip(d, a)], [r[:n + 1] for r, n in zip(t, a)]) if path else (d, t)
            self._watch(st, ctx, valid, anchors, d, t, model_drafts=self.drafts_are_model and not path)
        self.stats["rounds"] += 1
        st.rounds_since_update += 1
        if st.rounds_since_update >= st.update_period and len(st.buffer) >= self.cfg.min_pairs:
            self.update(st)

    @torch.no_grad()
    def make_pairs(self, ctx, valid, anchors, drafts, probs, accepted) -> list:
        """One ``Pair`` per request of a verify round (``learn_round``'s arguments), built batched."""
        (B, n), K, vi = drafts.shape, self.model.config.block_size, self._vocab_index
        rows = min(n + 1, K)  # verified rows the drafter has a position for
        p = probs[:, :rows].float()
        top_p, top_i = (t.cpu() for t in p.topk(min(self.cfg.tv_topk, p.shape[-1]), -1))
        kk = top_i.shape[-1]
        fb = torch.zeros(B, K, dtype=torch.int64)
        fb[:, :min(n, K)] = drafts[:, :K].cpu()
        n_valid = (torch.as_tensor(accepted, dtype=torch.int64).cpu() + 1).clamp_max(rows)
        labels = torch.full((B, K), -1, dtype=torch.int64)
        labels[:, :rows] = torch.where(torch.arange(rows)[None] < n_valid[:, None], vi[top_i[..., 0]], -1)
        top_idx = torch.full((B, K, kk), -1, dtype=torch.int64)
        top_idx[:, :rows] = vi[top_i]
        tp = torch.zeros(B, K, kk)
        tp[:, :rows] = top_p
        ctx, valid = ctx.detach().clone(), valid.clone()  # the round's tensors are not kept
        return [Pair(ctx[b], valid[b], a, fb[b], labels[b], top_idx[b], tp[b])
                for b, a in enumerate(anchors.tolist())]

    @torch.no_grad()
    def _watch(self, st: _State, ctx, valid, anchors, drafts: list, target_tokens: list,
               model_drafts: Optional[bool] = None) -> None:
        """Score the adapted and the shipped chains on this round's requests; revert on a losing window.
        Where the verified drafts are the adapted chain (``model_drafts``), the shipped one is cut to their length."""
        t0 = time.perf_counter()
        model_drafts = self.drafts_are_model if model_drafts is None else model_drafts
        ctx, anchors = ctx.contiguous(), anchors.to(ctx.device, torch.int64)
        self.shipped.to(ctx.device)
        shipped = self.shipped.propose(ctx, valid, anchors).tokens.tolist()
        adapted = drafts if model_drafts else self.model.propose(ctx, valid, anchors).tokens.tolist()
        for b, (d, t) in enumerate(zip(drafts, target_tokens)):
            s_chain = shipped[b][:len(d)] if model_drafts else shipped[b]
            st.window.append((chain_accepted(adapted[b], d, t), chain_accepted(s_chain, d, t)))
        self.stats["shadow_ms"] += (time.perf_counter() - t0) * 1e3
        self.stats["watched"] += 1
        if len(st.window) >= st.window.maxlen:
            a = sum(x for x, _ in st.window) / len(st.window)
            s = sum(y for _, y in st.window) / len(st.window)
            if a < s - self.cfg.watchdog_margin:
                self.stats["reverts"] += 1
                self.revert(st)
            else:
                st.window.clear()  # one verdict per window

    # ------------------------------------------------------------------ learning
    def _batch(self, st: _State) -> list:
        buf = list(st.buffer)
        n = min(self.cfg.batch_size, len(buf))
        r = min(self.cfg.recent, n)
        rest = buf[:len(buf) - r]
        pick = torch.randperm(len(rest), generator=self.generator)[:n - r].tolist() if rest else []
        return [rest[i] for i in pick] + buf[len(buf) - r:]

    def loss(self, pairs: list) -> torch.Tensor:
        """The stabilize stage's CE + TV of the working model on ``pairs`` (drafting vocabulary)."""
        dev = self.model.mask_embed.device
        ctx = torch.stack([p.context for p in pairs]).to(dev)
        valid = torch.stack([p.valid for p in pairs]).to(dev)
        anchor = torch.tensor([p.anchor for p in pairs], device=dev)
        fb = torch.stack([p.feedback for p in pairs]).to(dev)
        labels = torch.stack([p.labels for p in pairs]).to(dev)
        y = self.model.head_states(ctx, valid, anchor, feedback_tokens=fb)
        logits = self.model.draft_logits(y)  # [B, K, N]
        ok = labels >= 0
        w = self.weights.to(dev)
        loss = self.cfg.ce_weight * weighted_ce(logits, labels.clamp_min(0), ok, w)
        if self.cfg.tv_weight:
            idx = torch.stack([p.top_idx for p in pairs]).to(dev)
            tp = torch.stack([p.top_p for p in pairs]).to(dev)
            target = torch.zeros_like(logits, dtype=torch.float32)
            target.scatter_add_(-1, idx.clamp_min(0), torch.where(idx >= 0, tp, torch.zeros_like(tp)))
            loss = loss + self.cfg.tv_weight * tv_distance(target, logits, ok, w)
        return loss

    def update(self, st: _State) -> None:
        """``steps`` optimizer steps on batches of ``st``'s buffer; then (server) the decay."""
        t0 = time.perf_counter()
        st.rounds_since_update = 0
        with torch.enable_grad():
            for _ in range(self.cfg.steps):
                st.optim.zero_grad(set_to_none=True)
                self.loss(self._batch(st)).backward()
                for p, m in zip(self.trainable, self.masters):
                    if m is not p:
                        m.grad, p.grad = p.grad.float(), None
                torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
                st.optim.step()
                self._sync_masters()
                self.stats["steps"] += 1
                if self.cfg.max_update_ms is not None and (time.perf_counter() - t0) * 1e3 > self.cfg.max_update_ms:
                    self.stats["budget_cut"] += 1
                    break
        if self.cfg.scope == "server" and self.cfg.decay:
            with torch.no_grad():
                for m, n in zip(self.masters, self.names):
                    m.lerp_(self.shipped_values[n].to(m.device), self.cfg.decay)
                self._sync_masters()
        self._save(st)
        st.adapted = True
        self.stats["updates"] += 1
        ms, budget = (time.perf_counter() - t0) * 1e3, self.cfg.max_update_ms
        self.stats["update_ms"] += ms
        if self.cfg.scope == "server" and budget:  # paced: an update past its budget delays the next one
            st.update_period = max(self.cfg.update_every, math.ceil(self.cfg.update_every * ms / budget))

    def summary(self) -> dict:
        s = dict(self.stats)
        r = max(1, s["rounds"])
        s.update(config={f.name: getattr(self.cfg, f.name) for f in fields(self.cfg)},
                 trainable_values=sum(v.numel() for v in self.shipped_values.values()),
                 learn_ms_per_round=s["observe_ms"] / r, update_ms_per_round=s["update_ms"] / r,
                 shadow_ms_per_round=s["shadow_ms"] / r)
        return s
