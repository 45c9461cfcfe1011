"""Online learning in the DLITE worker: the setting ``online`` (``settings.py``).

The learner of ``drafting/online.py`` (``OnlineLearner``) at **server scope**: one adapted working
copy of the drafter for the whole batch (per-session weights cannot batch), decayed back towards
the shipped weights after every update. The worker drafts with that copy (``attach`` hands it over
in place of the shipped drafter, so CUDA graphs and tree rounds use it too: updates write its
parameters in place) and passes each verify round to ``observe`` (a tree round's accepted root path
to ``observe_tree``): the rows the drafter read (the carried ``state``), the anchor, the verified
block, the target's verify logits after sglang's logit processing and the accepted count; opted-out
rows are skipped. Updates run inside the round, each within ``max_update_ms``
(``online_config.SERVING_DEFAULTS``; an update past it delays the next one).

Rails: output stays lossless (verification is unchanged, only drafts move); the shipped drafter is
never written; the watchdog, or a non-finite update, reverts to the shipped weights; any error is
logged once and disables learning instead of reaching the serving loop. A bf16 drafter trains
float32 master copies (``OnlineLearner.masters``); on a CPU its trained linears' prepacked weights
are rebuilt after every write. Under tensor parallelism every rank learns from the same rounds.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.online import OnlineLearner
from sglang_dlite.drafting.online_config import OnlineConfig
from sglang_dlite.ops.cpu_linear import packed_for
from sglang_dlite.serving.info import unpack_context

logger = logging.getLogger(__name__)

LOG_EVERY = 512  # rounds between two one-line summaries in the log
# the learner's counts per round in the round log's "online" (``take_round``)
ROUND_COUNTS = ("updates", "gate_adapted", "gate_shipped", "gate_better", "gate_worse", "backed_off")


def _as_probs(rows: torch.Tensor) -> torch.Tensor:
    """The target's distribution per verify row: a row sglang's sampler already turned into
    probabilities in place (sampled requests) is kept, a logits row is softmaxed."""
    x = rows.float()
    is_p = (x >= 0).all(-1, keepdim=True) & ((x.sum(-1, keepdim=True) - 1).abs() < 1e-3)
    return torch.where(is_p, x, torch.softmax(x, -1))


class OnlineServing:
    """The serving side's learner: owns the adapted working copy (``model``) and its server state."""

    def __init__(self, shipped: DLiteDrafter, cfg: OnlineConfig, drafts_are_model: bool = False):
        if cfg.scope != "server":
            raise DLiteConfigError(f"DLITE online learning runs at server scope, got scope={cfg.scope!r}.")
        # DLite alone (no lookup): the verified drafts are the working copy's greedy chain
        self.learner = OnlineLearner(shipped, cfg, drafts_are_model=drafts_are_model)
        self.state = self.learner.state_for(None)  # the server's one state
        self.model = self.learner.model  # the model the worker drafts with: the learner's working copy
        mc = self.model.config
        self.L, self.H, self.V = mc.num_capture_layers, mc.target_hidden_size, mc.vocab_size
        self.enabled = True
        self.error: Optional[str] = None
        self.nonfinite = 0
        self._packed = self._packed_linears()
        self._taken: dict = {}  # the learner's time and counts at the last ``take_round``

    @classmethod
    def attach(cls, options, drafter: DLiteDrafter, lookup=None):
        """(the learner or None, the drafter the worker drafts with): the setting ``online`` off ->
        (None, ``drafter``); on -> (a learner, its working copy)."""
        if options.online is None:
            return None, drafter
        serving = cls(drafter, options.online, drafts_are_model=lookup is None)
        logger.info("DLITE %s", serving.learner.describe())
        return serving, serving.model

    def _packed_linears(self) -> list:
        """The trained linear layers whose forward runs on prepacked weights (``ops.pack_cpu_linears``)."""
        mods = dict(self.model.named_modules())
        out = []
        for name in self.learner.names:
            mod = mods.get(name.rpartition(".")[0])
            if isinstance(mod, torch.nn.Linear) and "forward" in vars(mod) and mod not in out:
                out.append(mod)
        return out

    # ------------------------------------------------------------------ the round
    def observe(self, state: torch.Tensor, anchors: torch.Tensor, block: torch.Tensor, logits: torch.Tensor,
                accepted: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        """One chain verify round: ``state`` [B, C, L*H+1] (``info.unpack_context``), ``anchors`` [B],
        ``block`` [B, W] = [anchor, drafts], ``logits`` [B, W, V'] the target's verify logits (V' may
        include sglang's vocabulary padding), ``accepted`` [B] drafts accepted, ``skip`` [B] bool rows
        to leave out (opted-out requests) or None. Never raises: an error disables learning."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(False), torch.no_grad():  # inference-mode inputs are cloned into pairs
                self._observe(state, anchors, block, logits, accepted, skip)
        except Exception as exc:  # noqa: BLE001  (the serving loop must go on: log, disable)
            self.disable(exc)
        self._spent(t0)

    def observe_tree(self, state: torch.Tensor, anchors: torch.Tensor, out: torch.Tensor, path_idx: torch.Tensor,
                     accepted: torch.Tensor, logits: torch.Tensor) -> None:
        """One tree round (``rounds.TreeRounds.learn``): the accepted root path is the chain, so
        the pair is a chain round's over it: ``out`` [B, N] the committed tokens (the path's drafts,
        then the bonus), ``path_idx`` [B, N] the path's node per committed token (-1 past it),
        ``accepted`` [B] the path's drafts, ``logits`` [B, N, V'] the verify logits per node: the
        rows of the path's nodes are the target's at every step of that chain. Never raises."""
        if not self.enabled or not self.learner.learns_tree_round(self.state):  # the back-off (``backoff``)
            return
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(False), torch.no_grad():
                a = accepted.cpu().to(torch.int64)
                m = int(a.max()) + 1  # rows up to the longest path's last node
                idx = path_idx[:, :m].clamp(min=0).to(logits.device)
                rows = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))
                block = torch.cat([anchors.reshape(-1, 1).to(out.device), out[:, :m - 1]], 1)
                self._observe(state, anchors, block, rows, a, None, path=True)
        except Exception as exc:  # noqa: BLE001  (the serving loop must go on: log, disable)
            self.disable(exc)
        self._spent(t0)

    def _spent(self, t0: float) -> None:
        self.learner.stats["observe_ms"] += (time.perf_counter() - t0) * 1e3

    def take_round(self) -> dict:
        """The round log's fields (``metrics.RoundTimer``) for the round just finished: ``learn_ms`` the
        learner's time in it (pairs, watchdog, updates, the gate's verdicts; the gate's second tree is
        drafting time) and ``online``, what it counted in it (``ROUND_COUNTS``: updates, tree-gate rounds
        on the adapted tree, on the shipped tree, verdicts better, worse, tree rounds the back-off skipped):
        the learner's stats since the last call."""
        s = self.learner.stats
        now = {k: s[k] for k in ("observe_ms",) + ROUND_COUNTS}
        last, self._taken = self._taken, now
        return {"learn_ms": round(now["observe_ms"] - last.get("observe_ms", 0.0), 3),
                "online": {k: now[k] - last.get(k, 0) for k in ROUND_COUNTS if now[k] != last.get(k, 0)}}

    def tree_gate(self, requests: int) -> Optional[tuple]:
        """A tree round's gate over its ``requests`` trees (``OnlineLearner.tree_gate`` on the server's
        state); None while learning is off."""
        return self.learner.tree_gate(self.state, requests) if self.enabled else None

    @property
    def shipped(self) -> DLiteDrafter:
        """The shipped drafter (never written): the gate's other tree, and its tree while it loses."""
        return self.learner.shipped

    def judge_trees(self, others: list, verified_adapted: bool, out: torch.Tensor, accepted: torch.Tensor) -> None:
        """A judged tree round: ``others`` the trees not verified (per request), ``out`` [B, N] the
        committed tokens, ``accepted`` [B]; the verdicts into the server state's gate. Never raises."""
        t0 = time.perf_counter()
        try:
            a = accepted.tolist()
            rows = out.tolist()
            for b, tree in enumerate(others):
                self.learner.judge_tree(self.state, verified_adapted, tree, rows[b][:a[b] + 1], a[b])
        except Exception as exc:  # noqa: BLE001  (the serving loop must go on: log, disable)
            self.disable(exc)
        self._spent(t0)

    def _observe(self, state, anchors, block, logits, accepted, skip, path: bool = False) -> None:
        if skip is not None:
            keep = (~skip.to(torch.bool)).nonzero().flatten()
            if keep.numel() == 0:
                return
            if keep.numel() < skip.numel():
                state, anchors, block, logits, accepted = (t[keep] for t in (state, anchors, block, logits, accepted))
        ctx, valid = unpack_context(state, self.L, self.H)
        probs = _as_probs(logits[..., :self.V])
        args = (self.state, ctx, valid, anchors.to(torch.int64), block[:, 1:].to(torch.int64), probs, accepted, path)
        stats = self.learner.stats
        before = (stats["updates"], stats["reverts"])
        self.learner.learn_round(*args)
        if (stats["updates"], stats["reverts"]) != before:
            self._after_write()
        if stats["rounds"] % LOG_EVERY == 0 or (stats["updates"] == 1 and before[0] == 0):  # and the first update
            logger.info("DLITE online: %s", self.describe_stats())

    @torch.no_grad()
    def _after_write(self) -> None:
        """After an update or a revert: a non-finite value reverts to the shipped weights; the packed
        copies of the trained linears are rebuilt (they would be lazily too: ``packed_for`` keys on
        the weight's version; rebuilt here so the cost falls in the update, not in a draft)."""
        if not all(bool(torch.isfinite(m).all()) for m in self.learner.masters):
            self.nonfinite += 1
            logger.warning("DLITE online: an update left non-finite weights; back to the shipped weights")
            self.learner.revert(self.state)
        for lin in self._packed:
            lin._dlite_packed_key = None
            packed_for(lin, lin.weight)

    def disable(self, exc: BaseException) -> None:
        """Stop learning after an error: logged once, drafting goes on with the shipped weights."""
        self.enabled = False
        self.error = f"{type(exc).__name__}: {exc}"
        logger.error("DLITE online learning failed and is now off (drafting goes on with the shipped "
                     "weights): %s", self.error, exc_info=exc)
        try:
            with torch.inference_mode(False):
                self.learner.revert(self.state)
                self._after_write()
        except Exception:  # noqa: BLE001  (the revert itself failed: drafts may suffer, output cannot)
            logger.exception("DLITE online: the revert to the shipped weights failed too")

    def summary(self) -> dict:
        s = self.learner.summary()
        s.update(enabled=self.enabled, error=self.error, nonfinite=self.nonfinite)
        return s

    def describe_stats(self) -> str:
        s = self.summary()
        return (f"{s['rounds']} rounds, {s['updates']} updates ({s['steps']} steps, {s['budget_cut']} cut by the "
                f"budget), {s['reverts']} watchdog reverts, {s['learn_ms_per_round']:.2f} ms/round learning "
                f"({s['update_ms_per_round']:.2f} updates, {s['shadow_ms_per_round']:.2f} watchdog)"
                + (f", {s['backed_off']} tree rounds skipped by the back-off" if s["backed_off"] else "")
                + (f"; tree gate: {s['gate_adapted']} adapted / {s['gate_shipped']} shipped tree rounds, verdicts "
                   f"+{s['gate_better']} / -{s['gate_worse']}" if s["gate_adapted"] + s["gate_shipped"] else ""))

