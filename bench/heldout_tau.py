#!/usr/bin/env python
"""Held-out tau of several drafters on the SAME held-out anchors (cached features).

    python bench/heldout_tau.py --data artifacts/train/data --anchors 2048 \
        --drafter shipped=dlite run1=artifacts/train/ab_all/stabilize/model e3=eagle3 \
        --out artifacts/results/heldout_tau.json

Drafters: DLite checkpoint folders (``LABEL=PATH``; ``LABEL=dlite`` = the shipped one) and the KV
baselines (``LABEL=eagle3`` / ``dflash`` / ``dspark`` = where ``--drafter NAME`` loads from,
``LABEL=eagle3:PATH`` = a trained folder), scored through their training-time-test unroll (what
their engine drafter drafts), so DLite and EAGLE-3 compare on identical anchors.

The in-training evaluation (``sglang-dlite train --eval-anchors``) uses a few hundred anchors,
too few to tell two runs apart (std ~0.04 in tau). This draws one larger fixed set of anchors from
the held-out sequences of a gen-data folder (the trainer's hash split; generated spans only) and
evaluates every drafter on exactly those: tau = 1 + the number of leading drafts equal to the
target's greedy continuation (what a greedy round commits at that anchor), plus the acceptance
rate per draft position and a bootstrap 95 % interval. Drafters with different captured layers
read their own feature cache (``X.feat-l<ids>.npy``; computed with the target when missing).
Threads are pinned (``--threads``). Writes JSON and prints a markdown table.

The set is drawn from the held-out sequences the folder holds *now*: a folder that is still
growing gives another set tomorrow. ``--anchor-set FILE`` pins it: the first run writes the set
there (by sequence name, ``shard:index``), later runs read it back, so A/Bs made in different
sessions score the same anchors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch


from dlite_lab.baselines.registry import KV_BASELINES, load_kv_baseline
from dlite_lab.baselines.train import heldout_scores
from sglang_dlite.model.dlite import load_dlite
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.errors import DLiteInputError
from sglang_dlite.drafting.tau import tau_of_committed
from dlite_lab.training.precision import warn_if_emulated_bf16
from sglang_dlite.model.bundled_target import load_target
from dlite_lab.training.data import MANIFEST, read_manifest, save_shard, shard_source, write_manifest
from dlite_lab.training.dataset import FeatureData, eval_groups
from dlite_lab.training.evaluation import greedy_scores


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.path.join("artifacts", "train", "data"), help="gen-data folder")
    p.add_argument("--drafter", nargs="+", required=True,
                   help="LABEL=PATH of DLite checkpoint folders (LABEL=dlite: the shipped one), or "
                        "LABEL=eagle3|dflash|dspark[:PATH] for a KV baseline")
    p.add_argument("--target", default="default")
    p.add_argument("--anchors", type=int, default=2048, help="held-out anchors (one fixed set for all drafters)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as training evaluates")
    p.add_argument("--exclude-prompts", nargs="+", default=None, metavar="SPEC",
                   help="drop held-out sequences whose prompt another run trained on: that run's gen-data "
                        "--prompts (e.g. the shipped v3's `sharegpt:480 bfcl:192 stdlib:192`), with --exclude-seed")
    p.add_argument("--exclude-seed", type=int, default=0, help="the --seed of the run named by --exclude-prompts")
    p.add_argument("--exclude-run", nargs="+", action="append", default=None, metavar="SEED SPEC",
                   help="like --exclude-prompts for one more run, its gen-data --seed first: `--exclude-run 1 "
                        "sharegpt:2000 agent:400`; repeat it for every run a compared drafter's lineage trained on")
    p.add_argument("--anchor-set", default=None, metavar="JSON",
                   help="pin the held-out anchors across runs: read them from JSON when it exists (every sequence "
                        "it names must be in --data), else write the set chosen now there. Without it the set "
                        "depends on which shards --data holds today")
    p.add_argument("--pack", default=None, metavar="DIR",
                   help="also write the held-out set chosen now (its sequences' token ids and generated-span "
                        "masks, no features, and the anchors) as a self-contained folder; `--data DIR` then scores "
                        "on exactly those anchors on any machine, after the gen-data folder is gone")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON file")
    return p.parse_args(argv)


def save_anchor_set(path: str, data: FeatureData, groups, meta: dict) -> None:
    """The held-out anchors of ``groups`` by sequence name (``shard file:index``), for --anchor-set."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    seqs = [{"name": data.seqs[si][4], "anchors": [int(x) for x in a]} for si, a in groups]
    with open(path, "w") as f:
        json.dump({"format": 1, **meta, "sequences": seqs}, f, indent=1)


def load_anchor_set(path: str, data: FeatureData, data_dir: str):
    """Groups ``[(sequence index in data, anchors)]`` from an --anchor-set file; a sequence that is
    missing from ``data`` or whose anchors are no longer anchors there is an error that says so."""
    with open(path) as f:
        pinned = json.load(f)
    by_name = {s[4]: i for i, s in enumerate(data.seqs)}
    groups, missing, changed = [], [], []
    for e in pinned.get("sequences", []):
        si = by_name.get(e["name"])
        if si is None:
            missing.append(e["name"])
            continue
        a = np.asarray(e["anchors"], dtype=np.int64)
        if not np.isin(a, data.seqs[si][3]).all():
            changed.append(e["name"])
        groups.append((si, a))
    if missing or changed or not groups:
        raise DLiteInputError(
            f"--anchor-set {path} does not fit --data {data_dir}: "
            + (f"{len(missing)} pinned sequence(s) are not there (e.g. {missing[0]}); " if missing else "")
            + (f"{len(changed)} sequence(s) changed (e.g. {changed[0]}: a pinned anchor is not an anchor now); "
               if changed else "")
            + ("it names no sequence; " if not pinned.get("sequences") else "")
            + "score on the folder the set was made from, or pass a new --anchor-set path to pin a new set.")
    return groups


def bootstrap_ci(committed: np.ndarray, n: int = 1000, seed: int = 0):
    """95 % bootstrap interval of τ over anchors (``committed``: each anchor's committed tokens)."""
    rng = np.random.default_rng(seed)
    means = np.array([tau_of_committed(committed[rng.integers(0, len(committed), len(committed))])
                      for _ in range(n)])
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def source_of(name: str) -> str:
    """A held-out sequence's prompt source: its shard file's prefix (gen-data writes
    ``<source>_<n>.npz``, e.g. ``agent_00003.npz:5`` -> ``agent``)."""
    return shard_source(name.split(":")[0])


def by_source(committed: np.ndarray, data: FeatureData, groups) -> dict:
    """tau, first-position acceptance and anchor count per prompt source (the pooled mean hides a
    mix: a held-out set of mostly synthetic agent traces reads higher than a chat workload);
    ``committed``: each anchor's committed tokens (1 + leading accepted drafts)."""
    src = np.concatenate([[source_of(data.seqs[si][4])] * len(a) for si, a in groups]) if groups else np.array([])
    if len(src) != len(committed):  # not one score per pinned anchor: no breakdown rather than a wrong one
        return {}
    return {s: {"tau": round(tau_of_committed(committed[src == s]), 4),
                "pos1": round(float((committed[src == s] >= 2).mean()), 4),
                "anchors": int((src == s).sum())} for s in sorted(set(src.tolist()))}


def heldout_tau(model, data: FeatureData, groups, bf16: bool) -> dict:
    cfg = model.config
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    if isinstance(model, DLiteDrafter):
        if cfg.history_window != 0:
            raise DLiteInputError("heldout_tau evaluates history-free DLite checkpoints (history=none), "
                                  f"not history={cfg.history!r}.")
        committed, acc = greedy_scores(model, data, groups, ctx)
    else:  # a KV baseline
        committed, acc = heldout_scores(model, data, groups, ctx)
    committed = committed.numpy()  # per anchor: the committed tokens of one greedy round there
    lo, hi = bootstrap_ci(committed)
    return {"tau": round(tau_of_committed(committed), 4), "tau_ci95": [round(lo, 4), round(hi, 4)],
            "anchors": int(len(committed)), "acc_per_pos": [round(float(x), 4) for x in acc],
            "by_source": by_source(committed, data, groups)}


def drop_seen_prompts(data: FeatureData, data_dir: str, specs, seed: int) -> dict:
    """Keep only held-out sequences whose conversation is not among ``specs``' prompts (a clean
    A/B against a drafter trained on them); returns what was dropped."""
    from dlite_lab.training.data import read_manifest
    from dlite_lab.training.prompts import parse_source, prompt_ids, sequence_prompt_ids

    names = {parse_source(s)[0] for s in specs}
    seen = prompt_ids(specs, seed, names=names)
    conv = sequence_prompt_ids(read_manifest(data_dir).get("recipe", {}), names=names)
    before = len(data.eval_idx)
    data.eval_idx = [i for i in data.eval_idx if conv.get(data.seqs[i][4]) not in seen]
    if not data.eval_idx:
        raise DLiteInputError(f"every held-out sequence of {data_dir!r} comes from a prompt in {' '.join(specs)}: "
                              "nothing clean to evaluate.")
    info = {"specs": list(specs), "seed": seed, "heldout_sequences_before": before,
            "heldout_sequences_after": len(data.eval_idx)}
    print(f"held-out sequences: {before} -> {len(data.eval_idx)} (dropped those whose prompt is in "
          f"{' '.join(specs)}, seed {seed})", flush=True)
    return info


def exclusion_runs(args) -> list:
    """[(seed, specs)] of every run named by --exclude-prompts/--exclude-seed and --exclude-run."""
    runs = [(args.exclude_seed, list(args.exclude_prompts))] if args.exclude_prompts else []
    for item in args.exclude_run or []:
        try:
            seed = int(item[0])
        except ValueError:
            seed = None
        if seed is None or len(item) < 2:
            raise DLiteInputError(f"--exclude-run {' '.join(item)}: give the run's gen-data --seed first, then its "
                                  "--prompts, e.g. `--exclude-run 1 sharegpt:2000 agent:400`.")
        runs.append((seed, list(item[1:])))
    return runs


def drop_seen_runs(data: FeatureData, data_dir: str, runs) -> list:
    """drop_seen_prompts for each (seed, specs) run; returns what each dropped."""
    return [drop_seen_prompts(data, data_dir, specs, seed) for seed, specs in runs]


PACK_FORMAT = "dlite-heldout-pack/1"
PACK_FEATURES_NOTE = "features are recomputed from the target into this folder on first use (X.feat-l*.npy)"


def is_pack(data_dir: str) -> bool:
    """Whether ``data_dir`` is a held-out pack written by --pack (not a gen-data folder)."""
    try:
        return read_manifest(data_dir).get("format") == PACK_FORMAT
    except DLiteInputError:  # no manifest or not JSON: not a pack (FeatureData says what is wrong with it)
        return False


def write_pack(out_dir: str, data: FeatureData, groups, meta: dict) -> dict:
    """The held-out sequences of ``groups`` (token ids + generated-span masks, ~5 bytes a token; the
    target's features are recomputed on first use) with their anchors, as a folder that --data
    reads back: an A/B made on another machine, after the gen-data folder is gone, scores the same
    anchors. One shard per prompt source (the by-source breakdown keeps working); every sequence
    records the gen-data sequence it came from. Never overwrites a pack."""
    if os.path.exists(os.path.join(out_dir, MANIFEST)):
        raise DLiteInputError(f"--pack {out_dir}: a pack is already there; pick a new folder (a pack is never "
                              "overwritten: its anchors are what later A/Bs compare on).")
    os.makedirs(out_dir, exist_ok=True)
    by_src = {}
    for si, a in groups:
        k, start, n, _, name = data.seqs[si]
        ids, mask, _ = data.shards[k]
        by_src.setdefault(source_of(name), []).append((name, ids[start:start + n], mask[start:start + n], a))
    shards, seqs = [], []
    for src, items in sorted(by_src.items()):
        fname = f"{src}_00000.npz"
        shards.append(save_shard(os.path.join(out_dir, fname), [x[1] for x in items], [x[2] for x in items]))
        seqs += [{"name": f"{fname}:{j}", "origin": x[0], "anchors": [int(v) for v in x[3]]} for j, x in enumerate(items)]
    manifest = {"format": PACK_FORMAT, **meta, "features": PACK_FEATURES_NOTE, "shards": shards, "sequences": seqs}
    write_manifest(out_dir, manifest)
    return manifest


def load_pack(data_dir: str, layer_ids, target):
    """(FeatureData over every sequence of a pack, its pinned anchor groups)."""
    data = FeatureData(data_dir, list(layer_ids), heldout_mod=0, model_loader=lambda: target, progress=False)
    data.eval_idx = list(range(len(data.seqs)))  # a pack is all held-out
    return data, load_anchor_set(os.path.join(data_dir, MANIFEST), data, data_dir)


def check_pack_options(args, runs) -> None:
    """A pack is already a fixed, clean set: options that choose or filter a set do not apply."""
    if not is_pack(args.data):
        return
    clash = [name for name, on in (("--exclude-prompts/--exclude-run", bool(runs)), ("--anchor-set", bool(args.anchor_set)),
                                   ("--pack", bool(args.pack))) if on]
    if clash:
        raise DLiteInputError(f"--data {args.data} is a held-out pack (its sequences and anchors are fixed and were "
                              f"filtered when it was written): drop {', '.join(clash)}.")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        runs = exclusion_runs(args)
        check_pack_options(args, runs)
    except DLiteInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.bf16:
        warn_if_emulated_bf16("heldout_tau")
    target, _ = load_target(args.target)
    specs = []
    for item in args.drafter:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = os.path.basename(item.rstrip("/")), item
        specs.append((label, None if path == "dlite" else path))
    datas, pinned, rows, excluded = {}, {}, [], None  # per captured-layer set: its features, its anchors
    pack, packed = is_pack(args.data), False
    for label, path in specs:
        kind, _, kv_path = (path or "").partition(":")
        if kind in KV_BASELINES:
            model = load_kv_baseline(kind, kv_path or None, target)
            path = f"{kind}:{kv_path or 'default'}"
        else:
            model = load_dlite(path, target).eval()
        ids = tuple(model.config.target_layer_ids)
        if ids not in datas and pack:
            datas[ids], pinned[ids] = load_pack(args.data, ids, target)
            excluded = read_manifest(args.data).get("excluded_prompts")
        elif ids not in datas:
            datas[ids] = FeatureData(args.data, list(ids), model_loader=lambda: target, progress=False)
            if runs:
                excluded = drop_seen_runs(datas[ids], args.data, runs)
                excluded = excluded[0] if len(excluded) == 1 else excluded  # one run: the JSON shape it always had
            if args.anchor_set and os.path.exists(args.anchor_set):
                pinned[ids] = load_anchor_set(args.anchor_set, datas[ids], args.data)
            else:
                pinned[ids] = eval_groups(datas[ids], args.anchors, seed=args.seed)
                if args.anchor_set:
                    save_anchor_set(args.anchor_set, datas[ids], pinned[ids],
                                    {"data": args.data, "anchors_requested": args.anchors, "seed": args.seed,
                                     "excluded_prompts": excluded})
                    print(f"held-out anchors pinned: {args.anchor_set} "
                          f"({sum(len(a) for _, a in pinned[ids])} anchors)", flush=True)
            if args.pack and not packed:
                m = write_pack(args.pack, datas[ids], pinned[ids],
                               {"data": args.data, "anchors_requested": args.anchors, "seed": args.seed,
                                "excluded_prompts": excluded})
                packed = True
                print(f"held-out pack written: {args.pack} ({len(m['sequences'])} sequences, "
                      f"{sum(sh['num_tokens'] for sh in m['shards'])} tokens, "
                      f"{sum(len(e['anchors']) for e in m['sequences'])} anchors)", flush=True)
        data, groups = datas[ids], pinned[ids]
        r = {"drafter": label, "path": path or "shipped", "layers": list(ids), **heldout_tau(model, data, groups, args.bf16)}
        rows.append(r)
        print(json.dumps(r), flush=True)
    res = {"data": args.data, "anchors_requested": args.anchors, "seed": args.seed, "threads": torch.get_num_threads(),
           "bf16": args.bf16, "excluded_prompts": excluded, "anchor_set": args.anchor_set, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print("\n| drafter | layers | held-out tau | 95 % CI | anchors | P[accept] per position | by source: tau / pos 1 (anchors) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        src = ", ".join(f"{k} {v['tau']:.2f} / {v['pos1']:.2f} ({v['anchors']})" for k, v in r["by_source"].items())
        print(f"| {r['drafter']} | {r['layers']} | {r['tau']:.3f} | {r['tau_ci95'][0]:.3f}-{r['tau_ci95'][1]:.3f} | "
              f"{r['anchors']} | {r['acc_per_pos']} | {src or '–'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
