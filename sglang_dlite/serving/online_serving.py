"""Online learning in the DLITE worker (issue 47): the setting ``online`` (``options.py``).

The reference engine's learner (``sglang_dlite/drafting/online.py``: ``OnlineLearner``, its parameter sets,
the stabilize loss, the bounded buffer, the watchdog, the decay) at **server scope**: one adapted
working copy of the drafter for the whole batch (per-session weights cannot batch), decayed back
towards the shipped weights after every update. The worker drafts with that copy (``attach``
hands it over in place of the shipped drafter, so the drafter's CUDA graphs and tree rounds use it
too: updates write its parameters in place) and, after each chain verify round, passes the round
to ``observe`` (a tree round: its accepted root path, a chain, to ``observe_tree``): per request the rows the drafter read (the carried ``state``), the anchor, the
verified block [anchor, drafts], the target's verify logits after sglang's logit processing and
the accepted count; opted-out rows are skipped. Every ``update_every`` rounds an update takes up to
``steps`` optimizer steps, stopping once past ``max_update_ms`` (the serving default
``online_config.SERVING_DEFAULTS``; one step always runs); an update past the budget delays the next one
(``OnlineLearner.update``: updates average at most the budget per ``update_every`` rounds), and the
watchdog compares on one round in ``watchdog_every`` (8 at server scope): learning has to cost less
than the acceptance it buys at concurrency 1.

With ``background=1`` a round only makes its pairs; the buffer, the watchdog and the updates run on
a thread of their own (``LearnerThread``) on the learner's working copy, whose values the drafting
model takes between rounds: no round waits on an update. ``background=0`` (the serving default,
``online_config.SERVING_DEFAULTS``) learns inside the round, each update within ``max_update_ms``
(deterministic with a seed): on a 2-core CPU the thread slowed every round more than it saved (it
preempts the scheduler's OpenMP team; 0.77x static tokens/s vs 0.95x inline at concurrency 1).

Rails: output stays lossless (verification is unchanged, only drafts move); the shipped drafter is
never written; a watchdog reverts to the shipped weights when the adapted chain loses; a
non-finite update reverts too; any error is logged once and disables learning (after a revert to
the shipped weights) instead of reaching the serving loop. A bf16 drafter trains float32 master
copies (``OnlineLearner.masters``) and on a CPU its trained linears' prepacked oneDNN weights
(``ops.pack_cpu_linears``) are rebuilt after every write. Under tensor parallelism every rank
learns from the same rounds; the verified drafts are rank 0's either way (``DLiteWorker.tp_same``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from contextlib import nullcontext
from typing import Optional

import torch

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.online import OnlineLearner, working_copy
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
        # the model the worker drafts with: the learner's working copy itself, or (background) a copy of
        # it that takes the learner's values between rounds (``publish``)
        self.model = working_copy(self.learner.model) if cfg.background else self.learner.model
        mc = self.model.config
        self.L, self.H, self.V = mc.num_capture_layers, mc.target_hidden_size, mc.vocab_size
        self.enabled = True
        self.error: Optional[str] = None
        self.nonfinite = 0
        self._packed = self._packed_linears()
        self.thread = LearnerThread(self) if cfg.background else None
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
        if self.thread is not None:
            self.thread.check()  # a failure on the learner's thread surfaces here (disable)
            self.thread.publish()  # the learner's newest values into the drafting model, between rounds
        if skip is not None:
            keep = (~skip.to(torch.bool)).nonzero().flatten()
            if keep.numel() == 0:
                return
            if keep.numel() < skip.numel():
                state, anchors, block, logits, accepted = (t[keep] for t in (state, anchors, block, logits, accepted))
        ctx, valid = unpack_context(state, self.L, self.H)
        probs = _as_probs(logits[..., :self.V])
        args = (self.state, ctx, valid, anchors.to(torch.int64), block[:, 1:].to(torch.int64), probs, accepted, path)
        if self.thread is not None:  # the round hands its pairs over and goes on
            self.thread.submit(*self.learner.round_pairs(*args))
            return
        self.learn(lambda: self.learner.learn_round(*args))

    def learn(self, step) -> None:
        """Run ``step`` (a round's learning) and what follows a write: the checks, the packed weights, the log."""
        stats = self.learner.stats
        before = (stats["updates"], stats["reverts"])
        step()
        if (stats["updates"], stats["reverts"]) != before:
            self._after_write()
        if stats["rounds"] % LOG_EVERY == 0 or (stats["updates"] == 1 and before[0] == 0):  # and the first update
            logger.info("DLITE online: %s", self.describe_stats())

    @torch.no_grad()
    def _after_write(self) -> None:
        """After an update or a revert: a non-finite value reverts to the shipped weights; the packed
        copies of the trained linears are rebuilt (they would be lazily too: ``packed_for`` keys on
        the weight's version; rebuilt here so the cost falls in the update, not in a draft). With a
        background thread (which calls this) the values are handed to ``publish`` instead."""
        if not all(bool(torch.isfinite(m).all()) for m in self.learner.masters):
            self.nonfinite += 1
            logger.warning("DLITE online: an update left non-finite weights; back to the shipped weights")
            self.learner.revert(self.state)
        if self.thread is not None:
            self.thread.offer([m.detach().clone() for m in self.learner.masters])
            return
        self._repack()

    @torch.no_grad()
    def _repack(self) -> None:
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
                if self.thread is not None:  # the thread stops; the drafting model takes the shipped values
                    self.thread.stop()
                    self.thread.write([self.learner.shipped_values[n] for n in self.learner.names])
                    return
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


class LearnerThread:
    """The setting ``online``'s ``background=1``: updates and the watchdog run
    on a daemon thread, so no decode round waits on one. A round only turns its verify result into
    pairs (``OnlineLearner.round_pairs``) and queues them (``submit``); the thread runs
    ``OnlineLearner.learn_pairs`` on them in order (buffer, watchdog, update, decay) on the learner's
    own working copy and offers the new values after every write (``offer``); the next round, before
    its pairs, copies the newest offer into the model the worker drafts with (``publish``: in place,
    so CUDA graphs keep their pointers). The queue is bounded: a round that finds it full drops its
    pairs (``dropped``) rather than wait. On a CPU the thread runs one torch thread beside the
    scheduler's, at a lower priority (nice ``NICE`` on Linux: it learns on the time the rounds leave
    idle); on a GPU its kernels go to the stream the worker ran on when it started (so they are ordered
    with the rounds' own work and free no memory a round still reads): the round's host time is what it
    saves there. Drafts lag the learner by up to an update, and which update a round drafts
    with depends on timing: a seed no longer makes drafts repeat run to run (output is lossless either way)."""

    QUEUE = 64  # rounds waiting for the thread at most
    NICE = 10  # the thread's nice value (Linux): on a CPU the learner takes what the rounds leave idle

    def __init__(self, serving: "OnlineServing"):
        self.serving, self.learner = serving, serving.learner
        params = dict(serving.model.named_parameters())
        self.targets = [params[n] for n in self.learner.names]  # the drafting model's trained parameters
        self.device = self.targets[0].device if self.targets else torch.device("cpu")
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.queue: "queue.Queue" = queue.Queue(maxsize=self.QUEUE)
        self.lock = threading.Lock()
        self.fresh = None  # the newest offered values not yet published
        self.failure: Optional[BaseException] = None
        self.dropped = self.published = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, name="dlite-online", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the serving side (a round)
    def submit(self, pairs: list, watch: Optional[tuple]) -> None:
        try:
            self.queue.put_nowait((pairs, watch))
        except queue.Full:
            self.dropped += 1

    def check(self) -> None:
        if self.failure is not None and self.serving.enabled:
            self.serving.disable(self.failure)

    @torch.no_grad()
    def publish(self) -> bool:
        """Copy the newest offered values into the drafting model (between rounds); False: none new."""
        with self.lock:
            fresh, self.fresh = self.fresh, None
        if fresh is None:
            return False
        self.write(fresh)
        self.published += 1
        return True

    @torch.no_grad()
    def write(self, values) -> None:
        for p, v in zip(self.targets, values):
            p.copy_(v.to(p.device, p.dtype))
        self.serving._repack()

    def stop(self) -> None:
        self.running = False
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass

    # ------------------------------------------------------------------ the learner's thread
    def offer(self, values: list) -> None:
        with self.lock:
            self.fresh = values

    def _run(self) -> None:
        torch.set_num_threads(1)  # OpenMP: this thread's own team; the scheduler's threads are untouched
        try:  # Linux: a thread's own nice value; the rounds' threads win the cores when both want them
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
            pass
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext(), \
                torch.inference_mode(False):
            while self.running:
                item = self.queue.get()
                try:
                    if item is None:
                        break
                    pairs, watch = item
                    self.serving.learn(lambda: self.learner.learn_pairs(self.serving.state, pairs, watch))
                except Exception as exc:  # noqa: BLE001  (reported to the serving side: it disables learning)
                    self.failure = exc
                    break
                finally:
                    self.queue.task_done()

    def join(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted round has been learned (tests, shutdown); False on timeout."""
        t0 = time.perf_counter()
        while self.queue.unfinished_tasks and time.perf_counter() - t0 < timeout and self.failure is None:
            time.sleep(0.005)
        return not self.queue.unfinished_tasks
