"""Training batches streamed from a gen-data folder, a window of shards at a time (``train
--stream-window W``), for data sets larger than memory.

* The shard list is fixed when a stage starts (a gen-data job may still be adding shards; they
  join the next run) and saved in the stage checkpoint.
* Epoch e visits the shards in a seeded permutation; ``W`` shards are open at a time (ids/mask
  loaded, features memory-mapped). Each open shard holds a seeded, shuffled work list of chunks:
  every training anchor of every training sequence exactly once per epoch, ``per`` anchors of one
  sequence per chunk. A batch takes ``seqs_per_batch`` chunks round-robin from the open shards; a
  shard whose work list is used up is closed and the next one in the permutation is opened.
* The state (files, epoch, position in the permutation, open shards and how many chunks of each
  were consumed, round-robin counter) is a small dict saved with the checkpoint: a resumed run
  continues with exactly the batches the uninterrupted run would have drawn, and never reopens a
  shard it had finished in this epoch.
* Held-out sequences (sha256 of ``file:index`` mod ``heldout_mod`` == 0, the rule of
  ``dataset.FeatureData``) are never trained on.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections import namedtuple

import numpy as np

from dlite_lab.training.data import DataError, load_shard
from dlite_lab.training.dataset import build_group
from dlite_lab.training.features import load_features


def is_heldout(name: str, heldout_mod: int) -> bool:
    return bool(heldout_mod) and int(hashlib.sha256(name.encode()).hexdigest(), 16) % heldout_mod == 0


# an open shard: its arrays and its shuffled work list of (start, length, anchors) chunks
_Shard = namedtuple("_Shard", "file ids mask feats work")


class ShardStream:
    def __init__(self, data_dir: str, layer_ids, files, window: int = 4, per: int = 16, anchor_tokens: str = "generated",
                 heldout_mod: int = 16):
        if window < 1:
            raise DataError("--stream-window must be >= 1.")
        if not files:
            raise DataError(f"{data_dir!r} lists no finished shards; run `sglang-dlite gen-data` first.")
        self.data_dir, self.layer_ids = data_dir, list(layer_ids)
        self.window, self.per, self.anchor_tokens, self.heldout_mod = window, max(1, per), anchor_tokens, heldout_mod
        self.files = list(files)
        self.seed = [0]
        self.epoch, self.next, self.rr = 0, 0, 0
        self.open: list = []  # [_Shard, consumed chunks]
        self.opened_log: list = []  # (epoch, file) of every shard this object loaded (tests, logs)
        self.max_open = 0
        self.chunks_done = 0

    # ------------------------------------------------------------------ state
    def start(self, seed) -> None:
        self.seed = [int(x) for x in (seed if isinstance(seed, (list, tuple)) else [seed])]
        self.epoch, self.next, self.rr, self.open, self.chunks_done = 0, 0, 0, [], 0

    def state_dict(self) -> dict:
        return {"files": list(self.files), "seed": list(self.seed), "epoch": self.epoch, "next": self.next, "rr": self.rr,
                "open": [[sh.file, c] for sh, c in self.open], "window": self.window, "per": self.per,
                "anchor_tokens": self.anchor_tokens, "heldout_mod": self.heldout_mod, "chunks_done": self.chunks_done}

    def load_state_dict(self, st: dict) -> None:
        for k in ("per", "anchor_tokens", "heldout_mod"):
            if st.get(k) != getattr(self, k):
                raise DataError(f"the checkpoint's data stream was made with {k}={st.get(k)!r}, this run has "
                                f"{getattr(self, k)!r}; resume with the same options (or start a new --out).")
        self.files, self.seed = list(st["files"]), list(st["seed"])
        self.epoch, self.next, self.rr = st["epoch"], st["next"], st["rr"]
        self.window = st.get("window", self.window)
        self.chunks_done = st.get("chunks_done", 0)
        self.open = [[self._load(f), c] for f, c in st["open"]]

    @property
    def epochs_done(self) -> float:
        """Completed epochs + the fraction of the current epoch's shards consumed: finished shards
        count whole, open ones by the share of their chunks drawn (moves with every batch)."""
        part = sum(c / len(sh.work) for sh, c in self.open if sh.work)
        return self.epoch + (self.next - len(self.open) + part) / max(1, len(self.files))

    # ------------------------------------------------------------------ shards
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + [epoch, 7]).permutation(len(self.files))

    def _load(self, fname: str) -> _Shard:
        path = os.path.join(self.data_dir, fname)
        ids, mask, off = load_shard(path)
        feats = load_features(path, self.layer_ids, len(ids))
        if feats is None:
            raise DataError(f"no features for {path!r} (layers {self.layer_ids}); run `python -m "
                            f"dlite_lab.training.features --data {self.data_dir} --layer-sets "
                            f"{','.join(map(str, self.layer_ids))}` (or train without --stream-window once) to compute them.")
        rng = np.random.default_rng(self.seed + [self.epoch, zlib.crc32(fname.encode())])
        work = []
        for s in range(len(off) - 1):
            a, b = int(off[s]), int(off[s + 1])
            if b - a < 3 or is_heldout(f"{fname}:{s}", self.heldout_mod):
                continue
            n = np.arange(1, b - a - 1)
            gen = n[mask[a:b][n + 1] == 1]
            if not len(gen):
                continue  # FeatureData's rule: a sequence without a generated span is not used
            anchors = n if self.anchor_tokens == "all" else gen
            anchors = rng.permutation(anchors)
            for k in range(0, len(anchors), self.per):
                work.append((a, b - a, np.sort(anchors[k:k + self.per])))
        order = rng.permutation(len(work))
        self.opened_log.append((self.epoch, fname))
        return _Shard(fname, ids, mask, feats, [work[i] for i in order])

    def _fill(self) -> None:
        empty = 0
        while len(self.open) < self.window:
            if self.next >= len(self.files):
                if self.open:
                    break
                self.epoch += 1
                self.next = 0
            idx = int(self._order(self.epoch)[self.next])
            self.next += 1
            sh = self._load(self.files[idx])
            if sh.work:
                self.open.append([sh, 0])
                empty = 0
            else:
                empty += 1
                if empty > len(self.files):  # a whole epoch without a training anchor
                    raise DataError(f"{self.data_dir!r}: no shard has a training anchor (a generated span outside "
                                    "the held-out split).")
        self.max_open = max(self.max_open, len(self.open))

    # ------------------------------------------------------------------ batches
    def next_batch(self, seqs_per_batch: int) -> list:
        """[(shard, start, length, anchors)] for one optimizer step."""
        out = []
        for _ in range(seqs_per_batch):
            self._fill()
            j = self.rr % len(self.open)
            sh, c = self.open[j]
            start, length, anchors = sh.work[c]
            out.append((sh, start, length, anchors))
            self.chunks_done += 1
            if c + 1 >= len(sh.work):
                self.open.pop(j)  # finished for this epoch: closed (its arrays are released)
            else:
                self.open[j][1] = c + 1
                self.rr += 1
        return out

    def group(self, ref, C: int, K: int, history, want_target: bool, all_tokens: bool = False) -> dict:
        sh, start, length, anchors = ref
        return build_group(sh.ids, sh.mask, sh.feats, start, length, anchors, len(self.layer_ids), sh.feats.shape[-1],
                           C, K, history, want_target, all_tokens)
