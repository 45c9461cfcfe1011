"""gen-data's output folder, shared by parallel workers (``--worker i/n``): the manifest read and
written under a file lock, one claim file per shard a worker generates, finished shards written
features first, and the run record every engine appends.

``shard_parts.py`` keeps the finished conversations of a shard still in flight.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from dlite_lab.training.data import MANIFEST, read_manifest, save_shard, write_manifest
from dlite_lab.training.exactness import relabel
from dlite_lab.training.features import save_features
from dlite_lab.training.shard_parts import conversation_key, drop_parts, load_parts, save_part


def locked_update(out, fn, new: Optional[dict] = None):
    """Read-modify-write the manifest under a file lock (parallel workers share it); ``new``: the
    manifest to start from where the folder has none yet."""
    with open(os.path.join(out, ".manifest.lock"), "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            exists = new is None or os.path.isfile(os.path.join(out, MANIFEST))
            m = fn(read_manifest(out) if exists else new)
            write_manifest(out, m)
            return m
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)


def stop_reason(args, t0: float) -> Optional[str]:
    """Why no new shard may start (the --budget-min wall budget is spent, or the output disk is
    below --min-free-gb), or None."""
    if getattr(args, "budget_min", None) is not None and time.time() - t0 > args.budget_min * 60:
        return f"--budget-min {args.budget_min} reached"
    free_gb = shutil.disk_usage(args.out).free / 1e9
    if free_gb < getattr(args, "min_free_gb", 0.0):
        return f"only {free_gb:.1f} GB free on {args.out!r} (< --min-free-gb {args.min_free_gb}: free space first)"
    return None


def claim(out, fname) -> bool:
    """Claim a shard for this process (a claim file with our pid; stale claims are taken over)."""
    path = os.path.join(out, fname + ".claim")
    if os.path.isfile(os.path.join(out, fname)):
        return False
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return True
        except FileExistsError:
            try:
                pid = int(open(path).read().strip() or 0)
                os.kill(pid, 0)
                return pid == os.getpid()
            except (ValueError, OSError):
                try:
                    os.remove(path)  # stale: its process is gone
                except OSError:
                    pass
    return False


class ShardWriter:
    """One worker's shards: which it claims (``claimed``), the write of a finished one (``write``:
    cut at the float32 target's greedy choice first with ``relabel``) and the run's record (``close``)."""

    def __init__(self, args, model, layers, worker: str, gen, todo: int, relabel: bool = False,
                 cuts: Optional[bool] = None):
        self.args, self.model, self.layers, self.worker, self.gen = args, model, layers, worker, gen
        k = getattr(args, "spec_drafts", 0) or 0  # the engine's tag in the shards and the run record
        self.tag = f"{args.engine}-{args.dtype}" + (f"-spec{k}" if args.engine == "fast" and k > 0 else "")
        self.relabel = relabel
        self.cuts = relabel if cuts is None else cuts  # the run record counts cut sequences (here or by the engine)
        self.t0 = time.time()
        self.totals = dict.fromkeys(("shards", "tokens_not_fp32_greedy", "sequences_cut", "generated_tokens_dropped"), 0)
        self.bar = tqdm(total=todo, desc=f"gen-data[{args.engine}]", unit="shard")

    def claimed(self, todo, stopping: str = "stopping"):
        """The shards of ``todo`` this worker claims (finished ones and another live worker's are
        skipped), until ``stop_reason`` stops it."""
        for fname, src, convs in todo:
            stop = stop_reason(self.args, self.t0)
            if stop:
                print(f"gen-data[{self.worker}]: {stop}; {stopping} (rerun to continue)", flush=True)
                return
            if claim(self.args.out, fname):
                yield fname, src, convs
            else:
                self.bar.update(1)

    def in_flight(self, todo):
        """The fast engine's view of the claimed shards: ((fname, index), conversation) of each
        conversation still to generate (those a stopped run finished are read back from
        ``shard_parts``); ``finished`` takes each back, and a shard is written with its last one."""
        self._pending = {}
        for fname, src, convs in self.claimed(todo, "finishing the claimed shards and stopping"):
            keys = [conversation_key(c, self.args, self.layers) for c in convs]
            done = load_parts(self.args.out, fname, keys)
            if done:
                print(f"gen-data[{self.worker}]: {fname}: {len(done)} of {len(convs)} conversations read back from "
                      f"{fname}.parts", flush=True)
            self._pending[fname] = (src, keys, done)
            if len(done) == len(convs):
                self._write_parts(fname)
            yield from (((fname, i), c) for i, c in enumerate(convs) if i not in done)

    def finished(self, key, seq, mask, feats, margin: float) -> None:
        """One finished conversation of ``in_flight``: saved at once beside its shard (a stopped
        run keeps it), and the shard written when it was the last."""
        fname, i = key
        _, keys, done = self._pending[fname]
        save_part(self.args.out, fname, i, keys[i], seq, mask, feats, margin)
        done[i] = (seq, mask, feats, margin)
        if len(done) == len(keys):
            self._write_parts(fname)

    def _write_parts(self, fname) -> None:
        src, keys, done = self._pending.pop(fname)
        seqs, masks, feats, margins = zip(*(done[i] for i in range(len(keys))))
        self.write(fname, src, list(seqs), list(masks), list(feats), {"min_logit_margin": round(min(margins), 6)})

    def write(self, fname, src, seqs, masks, feats, extra: Optional[dict] = None) -> None:
        """Write one finished shard (features first, then the ids: a shard on disk has its
        features) and add it to the manifest."""
        extra = {"engine": self.tag, **(extra or {})}
        if self.relabel:
            seqs, masks, feats, counts = relabel(self.model, seqs, masks, self.layers)
            extra.update(relabeled=True, sequences_cut=counts["sequences_cut"],
                         generated_tokens_dropped=counts["generated_tokens_dropped"])
        for k in self.totals:
            self.totals[k] += extra.get(k, 0)
        self.totals["shards"] += 1
        path = os.path.join(self.args.out, fname)
        if self.layers:
            H = self.model.config.hidden_size
            # A conversation whose first prompt is already too long generated nothing and has no
            # features (no anchor reads them): zero rows.
            arrays = [np.zeros((0, len(self.layers) + 1, H), np.float16) if f is None else np.asarray(f) for f in feats]
            save_features(path, arrays, np.cumsum([0] + [len(x) for x in seqs]), self.layers, H)
        info = {**save_shard(path, seqs, masks), "source": src, **extra}
        locked_update(self.args.out, lambda m: {**m, "shards": [x for x in m["shards"] if x["file"] != fname] + [info]})
        drop_parts(self.args.out, fname)
        self.bar.update(1)
        n, el = self.gen.new_tokens, time.time() - self.t0
        note = f", {extra['tokens_not_fp32_greedy']} not fp32-greedy" if "tokens_not_fp32_greedy" in extra else ""
        self.bar.set_postfix_str(f"{n / el:.1f} new tok/s, {n} new tokens")
        print(f"gen-data[{self.worker}]: {fname}: {info['num_seqs']} seqs, {info['num_tokens']} tokens "
              f"({info['num_loss_tokens']} generated{note}); total {n} new tokens, {n / el:.1f} tok/s", flush=True)

    def close(self, extra: dict, note: str = "") -> None:
        """Append this worker's run to the manifest (wall time, tokens/s, ``extra``) and print its line."""
        self.bar.close()
        if self.cuts:
            extra.update(sequences_cut=self.totals["sequences_cut"],
                         generated_tokens_dropped=self.totals["generated_tokens_dropped"])
        n, el = self.gen.new_tokens, time.time() - self.t0
        rec = {"worker": self.worker, "engine": self.tag, "new_shards": self.totals["shards"], "new_tokens": n,
               "wall_s": round(el, 1), "tokens_per_s": round(n / max(el, 1e-9), 1), "threads": self.args.threads,
               **extra}
        locked_update(self.args.out, lambda m: (m.setdefault("runs", []).append(rec), m)[1])
        print(f"gen-data: {self.totals['shards']} shards, {n} generated tokens in {el:.0f}s "
              f"({n / max(el, 1e-9):.1f} tok/s{note})")
