"""Target features for training, cached on disk as memory-mapped fp16 arrays.

For shard ``X.npz`` the features live in ``X.feat.npy``: float16 ``[N, L + 1, H]`` aligned with the
shard's concatenated ids, where rows ``0..L-1`` are the outputs of the captured decoder layers
(``target_layer_ids``, = HF ``hidden_states[l + 1]``) and row ``L`` is the output of the target's
final norm (so the target's logits at any position are the frozen LM head applied on the fly).
The last position of each sequence has no features (nothing reads them): its row is zero.

``X.feat.json`` records which layers were captured. gen-data captures the features while it
generates (hooks; no second target pass); ``sglang-dlite train`` computes missing ones with one
batched forward pass per shard (``ensure_features``). Training reads them with ``np.load(...,
mmap_mode="r")``: no target forward during training.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from tqdm.auto import tqdm

from dlite_lab.reference.engine import LayerCapture, decoder_layers
from sglang_dlite.model.bundled_target import load_target
from dlite_lab.training.data import DataError, load_shard, read_json, read_manifest


def feature_modules(model, layer_ids):
    """The modules whose outputs are a feature row: the captured decoder layers, then the final norm."""
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise DataError(f"layers {bad} do not exist in a target with {len(layers)} layers.")
    return [layers[i] for i in layer_ids] + [getattr(model, "model", model).norm]


def feat_paths(shard_path: str, layer_ids=None):
    """(array, metadata) paths. ``X.feat.npy`` holds the layers gen-data captured; features of any
    other layer set (e.g. a baseline's) live beside it in ``X.feat-l<ids>.npy``, so drafters with
    different capture layers train from the same data without overwriting each other's cache."""
    base = shard_path[:-4] if shard_path.endswith(".npz") else shard_path
    if layer_ids is None:
        return base + ".feat.npy", base + ".feat.json"
    tag = "-l" + "-".join(str(int(i)) for i in layer_ids)
    return base + ".feat" + tag + ".npy", base + ".feat" + tag + ".json"


def _paths_for(shard_path: str, layer_ids):
    """Where features of ``layer_ids`` are (or go): the primary file if it holds these layers
    (or does not exist yet), else the per-layer-set file."""
    npy, meta = feat_paths(shard_path)
    if not os.path.isfile(meta):
        return npy, meta
    have = read_json(meta)
    if have is None or list(have.get("layer_ids", [])) == list(layer_ids):  # unreadable: load_features reports it
        return npy, meta
    return feat_paths(shard_path, layer_ids)


def save_features(shard_path: str, feats: list, offsets, layer_ids, hidden: int) -> None:
    """feats[s]: array [len_s - 1 (or more), L+1, H] for sequence s."""
    npy, meta = _paths_for(shard_path, layer_ids)
    N = int(offsets[-1])
    tmp = npy + ".tmp"
    try:
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(N, len(layer_ids) + 1, hidden))
        for s, f in enumerate(feats):
            a, b = int(offsets[s]), int(offsets[s + 1])
            f = np.asarray(f, dtype=np.float16)
            n = min(len(f), b - a)
            arr[a:a + n] = f[:n]
            if n < b - a:
                arr[a + n:b] = 0
        arr.flush()
        del arr
        os.replace(tmp, npy)
        with open(meta + ".tmp", "w") as fh:
            json.dump({"layer_ids": list(layer_ids), "hidden": hidden, "num_tokens": N}, fh)
        os.replace(meta + ".tmp", meta)
    except OSError as exc:
        for p in (tmp, meta + ".tmp"):
            if os.path.exists(p):
                os.remove(p)
        raise DataError(f"could not write features for {shard_path!r} ({exc}); free disk space and rerun.") from exc


def load_features(shard_path: str, layer_ids, num_tokens: int):
    """Memory-mapped features of a shard, validated against the layers the drafter captures."""
    npy, meta = _paths_for(shard_path, layer_ids)
    if not (os.path.isfile(npy) and os.path.isfile(meta)):
        return None
    try:
        with open(meta) as fh:
            m = json.load(fh)
        arr = np.load(npy, mmap_mode="r")
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise DataError(f"features of {shard_path!r} are corrupt ({exc}); delete {npy!r} and rerun to recompute them.") from exc
    if list(m.get("layer_ids", [])) != list(layer_ids):
        return None  # captured for other layers: recompute
    if arr.ndim != 3 or arr.shape[0] != num_tokens or arr.shape[1] != len(layer_ids) + 1:
        raise DataError(f"features {npy!r} have shape {arr.shape}, expected [{num_tokens}, {len(layer_ids) + 1}, H]; delete it to recompute.")
    return arr


def padded_forward_groups(model, seqs, layer_ids, batch_tokens: int = 4096, *, logits: bool = False):
    """Teacher-forced target forwards over ``seqs`` in length-sorted groups of at most
    ``batch_tokens`` (right-padded) tokens. Yields ``(group, stack, logits)`` per group: the
    sequences' indices, their captured layers ``[len(group), T, L+1, H]`` fp16 (None without
    ``layer_ids``; on the CPU), and the LM logits when ``logits`` (on the target's device; else
    None: the LM head is skipped)."""
    mods = feature_modules(model, layer_ids) if layer_ids else []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    dev = next(model.parameters()).device  # a target on a GPU: inputs there, results back here
    runner = model if logits else getattr(model, "model", model)  # no LM head without logits
    with LayerCapture(mods) as cap:
        i = 0
        while i < len(order):
            group = [order[i]]
            while i + len(group) < len(order) and len(seqs[order[i + len(group)]]) * (len(group) + 1) <= batch_tokens:
                group.append(order[i + len(group)])
            i += len(group)
            Lmax = max(len(seqs[g]) for g in group)
            ids = torch.zeros(len(group), Lmax, dtype=torch.long)
            att = torch.zeros(len(group), Lmax, dtype=torch.long)
            for r, g in enumerate(group):
                ids[r, :len(seqs[g])] = torch.as_tensor(np.asarray(seqs[g], dtype=np.int64))
                att[r, :len(seqs[g])] = 1
            with torch.no_grad():
                out = runner(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False)
            stack = torch.stack([o[-1] for o in cap.take()], dim=2).to(torch.float16).cpu() if mods else None
            yield group, stack, (out.logits if logits else None)  # logits stay on the target's device


def compute_features(model, seqs, layer_ids, batch_tokens: int = 4096):
    """One batched (right-padded) target forward per group of sequences -> list of fp16 arrays."""
    out = [None] * len(seqs)
    for group, stack, _ in padded_forward_groups(model, seqs, layer_ids, batch_tokens):
        for r, g in enumerate(group):  # stack: [B, T, L+1, H]
            out[g] = stack[r, :len(seqs[g])].numpy()
    return out


def ensure_features(data_dir: str, shards: list, model_loader, layer_ids, progress=True):
    """Compute features for the shards that lack them (resumable: one file per shard)."""
    return ensure_feature_sets(data_dir, shards, model_loader, [layer_ids], progress=progress)


def ensure_feature_sets(data_dir: str, shards: list, model_loader, layer_sets, progress=True):
    """Like ``ensure_features`` for several layer sets at once: one target forward per shard
    captures the union of the sets, then each set is saved to its own cache file. Returns the
    number of shards that needed a forward pass."""
    layer_sets = [list(x) for x in layer_sets]
    model = None
    todo = []
    for sh in shards:
        path = os.path.join(data_dir, sh["file"])
        ids, mask, off = load_shard(path)
        missing = [ls for ls in layer_sets if load_features(path, ls, len(ids)) is None]
        if missing:
            todo.append((path, ids, off, missing))
    for path, ids, off, missing in tqdm(todo, desc="features", unit="shard", disable=not progress or not todo):
        if model is None:
            model = model_loader()
        union = sorted({i for ls in missing for i in ls})
        seqs = [ids[off[s]:off[s + 1]] for s in range(len(off) - 1)]
        feats = compute_features(model, seqs, union)  # rows: union layers..., final norm
        for ls in missing:
            cols = [union.index(i) for i in ls] + [len(union)]
            save_features(path, [f[:, cols] for f in feats], off, ls, model.config.hidden_size)
    return len(todo)


def main(argv=None) -> int:
    """``python -m dlite_lab.training.features --data DIR --layer-sets 10,12 2,15,27``:
    precompute the feature caches of several drafters in one target pass per shard."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--data", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--layer-sets", nargs="+", required=True, help="comma-separated layer ids per set")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sets = [[int(x) for x in s.split(",")] for s in args.layer_sets]
    shards = read_manifest(args.data).get("shards", [])
    if not shards:
        raise DataError(f"{args.data!r} lists no finished shards; run `sglang-dlite gen-data` first.")
    n = ensure_feature_sets(args.data, shards, lambda: load_target(args.target)[0], sets)
    print(f"features: {n} shard(s) computed for layer sets {sets}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
