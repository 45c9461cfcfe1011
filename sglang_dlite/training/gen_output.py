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

from .data import MANIFEST, read_manifest, save_shard, write_manifest
from .features import save_features


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


def stop_reason(args, t0: float, budget_s) -> Optional[str]:
    """Why no new shard may start (the --budget-min wall budget is spent, or the output disk is
    below --min-free-gb), or None."""
    if budget_s is not None and time.time() - t0 > budget_s:
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


def append_shard(out, info):
    def add(m):
        m["shards"] = [x for x in m["shards"] if x["file"] != info["file"]] + [info]
        return m
    return locked_update(out, add)


def save_generated(args, model, fname, src, seqs, masks, feats, layers, extra=None) -> dict:
    """Write one finished shard (features first, then the ids: a shard on disk has its features)."""
    if layers:
        off = np.cumsum([0] + [len(x) for x in seqs])
        H = model.config.hidden_size
        # A conversation whose first prompt is already too long generated nothing and has no
        # features (no anchor reads them): zero rows.
        arrays = [np.asarray(f) if f is not None else np.zeros((0, len(layers) + 1, H), np.float16) for f in feats]
        save_features(os.path.join(args.out, fname), arrays, off, layers, H)
    info = save_shard(os.path.join(args.out, fname), seqs, masks)
    info["source"] = src
    info.update(extra or {})
    append_shard(args.out, info)
    return info


def record_run(args, wi, wn, t0: float, new_shards: int, new_tokens: int, engine: Optional[str] = None,
               extra: Optional[dict] = None, note: str = "") -> None:
    """Append this worker's run to the manifest (wall time, tokens/s, ``extra``) and print its line."""
    el = time.time() - t0
    rec = {"worker": f"{wi}/{wn}", **({"engine": engine} if engine else {}), "new_shards": new_shards,
           "new_tokens": new_tokens, "wall_s": round(el, 1), "tokens_per_s": round(new_tokens / max(el, 1e-9), 1),
           "threads": args.threads, **(extra or {})}
    locked_update(args.out, lambda m: (m.setdefault("runs", []).append(rec), m)[1])
    print(f"gen-data: {new_shards} shards, {new_tokens} generated tokens in {el:.0f}s "
          f"({new_tokens / max(el, 1e-9):.1f} tok/s{note})")


def report_shard(bar, wi, wn, fname, info: dict, new_tokens: int, t0: float, note: str = "") -> None:
    """The progress bar's rate and one line per written shard."""
    el = time.time() - t0
    bar.set_postfix_str(f"{new_tokens / el:.1f} new tok/s, {new_tokens} new tokens")
    print(f"gen-data[{wi}/{wn}]: {fname}: {info['num_seqs']} seqs, {info['num_tokens']} tokens "
          f"({info['num_loss_tokens']} generated{note}); total {new_tokens} new tokens, {new_tokens / el:.1f} tok/s",
          flush=True)
