"""Training data: gen-data sequences with their memory-mapped target features, and the batches
of anchors the trainer and the evaluation draw from them (``build_group``: one round per anchor,
laid out as the engines run it; ``batch_vocab_subset``: the training-time vocabulary subset)."""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import numpy as np
import torch

from sglang_dlite.errors import DLiteInputError
from dlite_lab.ablations import History
from sglang_dlite.drafting.context import context_positions
from dlite_lab.training.data import DataError, load_shard, read_manifest
from dlite_lab.training.features import ensure_features, load_features

ANCHOR_TOKENS = ("generated", "all")


class FeatureData:
    """All sequences of a gen-data folder with their memory-mapped target features."""

    def __init__(self, data_dir: str, layer_ids, heldout_mod: int = 16, model_loader=None, progress=True,
                 anchor_tokens: str = "generated", shard_files=None):
        if anchor_tokens not in ANCHOR_TOKENS:
            raise DLiteInputError(f"anchor_tokens must be one of {', '.join(ANCHOR_TOKENS)}, not {anchor_tokens!r}.")
        self.anchor_tokens = anchor_tokens
        self.data_dir = data_dir
        man = read_manifest(data_dir)
        shards = man.get("shards", [])
        if shard_files is not None:  # a subset (the streaming trainer's held-out view)
            keep = set(shard_files)
            shards = [sh for sh in shards if sh["file"] in keep]
        if not shards:
            raise DataError(f"{data_dir!r} lists no finished shards; run `sglang-dlite gen-data` first.")
        if model_loader is not None:
            ensure_features(data_dir, shards, model_loader, layer_ids, progress=progress)
        self.L = len(layer_ids)
        self.shards = []  # (ids, mask, feats)
        self.seqs = []  # (shard index, start, length, generated-span anchors, name)
        for k, sh in enumerate(shards):
            path = os.path.join(data_dir, sh["file"])
            ids, mask, off = load_shard(path)
            feats = load_features(path, layer_ids, len(ids))
            if feats is None:
                raise DataError(f"no features for {path!r} (layers {list(layer_ids)}); run train with the target to compute them.")
            self.shards.append((ids, mask, feats))
            for s in range(len(off) - 1):
                a, b = int(off[s]), int(off[s + 1])
                m = mask[a:b]
                n = np.arange(1, b - a - 1)
                anchors = n[m[n + 1] == 1] if len(n) else n
                if len(anchors):
                    self.seqs.append((k, a, b - a, anchors, f"{sh['file']}:{s}"))
        if not self.seqs:
            raise DataError(f"{data_dir!r} has no sequence with a loss-masked (generated) span.")
        self.hidden = self.shards[0][2].shape[-1]
        held = [i for i, s in enumerate(self.seqs)
                if heldout_mod and int(hashlib.sha256(s[4].encode()).hexdigest(), 16) % heldout_mod == 0]
        if len(held) == len(self.seqs) or not held:  # tiny data: hold out the last sequence
            held = [len(self.seqs) - 1] if len(self.seqs) > 1 else []
        self.eval_idx = held
        self.train_idx = [i for i in range(len(self.seqs)) if i not in set(held)] or list(range(len(self.seqs)))
        self.num_train_anchors = int(sum(len(self.train_anchors(i)) for i in self.train_idx))
        train_ids = [self.shards[k][0][a:a + n] for k, a, n, _, _ in (self.seqs[i] for i in self.train_idx)]
        self.token_counts = np.bincount(np.concatenate(train_ids))  # occurrences of each id in the training split

    def train_anchors(self, seq_i: int) -> np.ndarray:
        """The anchors training samples from: positions whose next token the target generated
        ("generated"), or every position ("all": prompt text too; its labels are the real next
        tokens and its TV target the target's distribution there)."""
        _, _, length, generated, _ = self.seqs[seq_i]
        return np.arange(1, length - 1) if self.anchor_tokens == "all" else generated

    def frequent_tokens(self, n: int) -> torch.Tensor:
        """The n most frequent token ids of the training sequences (those that occur)."""
        order = np.argsort(-self.token_counts, kind="stable")
        order = order[self.token_counts[order] > 0][:n]
        return torch.from_numpy(np.sort(order).astype(np.int64))

    def group(self, seq_i: int, anchors, C: int, K: int, history: Optional[int], want_target: bool,
              all_tokens: bool = False):
        """Tensors for anchors of one sequence. history: 0 none, None full, W window. Labels are
        valid on generated tokens only, or on every token with ``all_tokens``."""
        k, start, length, _, _ = self.seqs[seq_i]
        ids, mask, feats = self.shards[k]
        return build_group(ids, mask, feats, start, length, anchors, self.L, self.hidden, C, K, history, want_target,
                           all_tokens)


def build_group(ids, mask, feats, start: int, length: int, anchors, L: int, H: int, C: int, K: int,
                history: Optional[int], want_target: bool, all_tokens: bool = False) -> dict:
    """``FeatureData.group`` on raw shard arrays (also used by the streaming loader, stream.py)."""
    n = np.asarray(anchors, dtype=np.int64)
    B = len(n)
    cpos, cvalid = (t.numpy() for t in context_positions(n, C))  # [B, C]: the C positions before each anchor
    ctx = np.asarray(feats[start + cpos.reshape(-1), :L], dtype=np.float32).reshape(B, C, L, H)
    ctx[~cvalid] = 0
    lpos = n[:, None] + 1 + np.arange(K)[None]  # [B, K]
    inside = lpos < length
    lp = np.clip(lpos, 0, length - 1)
    labels = ids[start + lp].astype(np.int64)
    lvalid = inside if all_tokens else inside & (mask[start + lp] == 1)
    out = {
        "context_hidden": torch.from_numpy(ctx).permute(0, 2, 1, 3).contiguous(),
        "context_valid": torch.from_numpy(cvalid),
        "anchor_ids": torch.from_numpy(ids[start + n].astype(np.int64)),
        "labels": torch.from_numpy(labels),
        "valid": torch.from_numpy(lvalid),
        "round_offset": torch.from_numpy(n - C),
    }
    if want_target:
        tpos = np.clip(n[:, None] + np.arange(K)[None], 0, length - 2)
        out["target_hidden"] = torch.from_numpy(
            np.asarray(feats[start + tpos.reshape(-1), L], dtype=np.float32).reshape(B, K, H))
    if history != 0:
        T = max(int(n.max()) - C, 0)
        if T > 0:
            hid = np.asarray(feats[start:start + T, :L], dtype=np.float32)  # [T, L, H]
            hpos = np.arange(T)
            hv = hpos[None, :] < (n[:, None] - C)
            if history is not None:
                hv &= hpos[None, :] >= (n[:, None] - C - history)
            out["history"] = History(
                hidden=torch.from_numpy(hid).permute(1, 0, 2)[None].contiguous(),
                positions=torch.from_numpy(hpos)[None], valid=torch.from_numpy(hv),
            )
    return out


def sample_batch(data: FeatureData, rng: np.random.Generator, batch_size: int, seqs_per_batch: int):
    """[(seq index, anchors)]: seqs_per_batch random training sequences, random anchors in each."""
    per = max(1, batch_size // seqs_per_batch)
    chosen = rng.choice(len(data.train_idx), size=min(seqs_per_batch, len(data.train_idx)), replace=False)
    groups = []
    for c in chosen:
        si = data.train_idx[c]
        anchors = data.train_anchors(si)
        take = rng.choice(anchors, size=min(per, len(anchors)), replace=False)
        groups.append((si, np.sort(take)))
    return groups


def eval_groups(data: FeatureData, max_anchors: int, seed: int = 1234):
    """A fixed set of held-out anchors, grouped by sequence."""
    rng = np.random.default_rng(seed)
    idx = data.eval_idx or data.train_idx[:1]
    per = max(1, max_anchors // max(len(idx), 1))
    out = []
    for si in idx:
        a = data.seqs[si][3]
        out.append((si, np.sort(rng.choice(a, size=min(per, len(a)), replace=False))))
    return out


def batch_vocab_subset(base_vocab: torch.Tensor, labels: list, valid: list, vocab_size: int, union=None):
    """The training-time vocabulary subset of one batch: the frequent tokens ``base_vocab`` plus
    every valid label. Returns (sorted token ids, labels remapped to their index in the subset;
    invalid positions get 0). ``union``: a function OR-ing the membership mask over the
    data-parallel ranks (distributed.union_mask), so every rank uses the global batch's subset."""
    mask = torch.zeros(vocab_size, dtype=torch.uint8)
    mask[base_vocab] = 1
    for lab, v in zip(labels, valid):
        mask[lab[v]] = 1
    if union is not None:
        mask = union(mask)
    vocab = mask.nonzero().squeeze(1)
    lookup = torch.full((vocab_size,), -1, dtype=torch.long)
    lookup[vocab] = torch.arange(len(vocab))
    return vocab, [torch.where(v, lookup[lab], torch.zeros_like(lab)) for lab, v in zip(labels, valid)]


def concat_groups(batches: list) -> dict:
    out = {}
    for key in batches[0]:
        if key == "history":
            continue
        out[key] = torch.cat([b[key] for b in batches], 0)
    return out


def to_device(b: dict, device: torch.device) -> dict:
    """A batch on ``device``: nothing to do on the CPU; on a GPU each tensor goes through pinned
    host memory with a non-blocking copy (the host builds the next batch while the GPU computes)."""
    if device.type == "cpu":
        return b

    def move(t):
        return t.pin_memory().to(device, non_blocking=True)

    out = {}
    for k, v in b.items():
        if isinstance(v, History):
            out[k] = History(hidden=move(v.hidden), positions=move(v.positions), valid=move(v.valid))
        elif torch.is_tensor(v):
            out[k] = move(v)
        else:
            out[k] = v
    return out
