#!/usr/bin/env python
"""Fit the hybrid chooser's calibration on TRAINING prompts (never on evaluation workloads).

    python bench/lookup_calibration.py --prompts stdlib:16 sharegpt:16 bfcl:12 --max-new-tokens 128 \
        --threads 1 --out artifacts/results/lookup/calibration_run.json \
        --write-calibration sglang_dlite/drafting/calibration.json --plot bench/plots/lookup_calibration.png

Prompts come from gen-data's training sources (``dlite_lab.training.prompts.load_prompts``:
the sharegpt train split, stdlib files disjoint from agent-stdlib, bfcl single-turn categories).
Each is generated greedily by the reference engine with hybrid drafting under the prior
calibration, logging every round's candidates: the lookup's chain, DLite's greedy chain with its
confidences, and the lookup's continuation after each prefix of DLite's chain. Greedy output is
the target's own, so every candidate's accepted length is known afterwards (longest common
prefix with what the target generated), whichever candidate the round verified.

Fits: P(accepted | reached) per lookup cell (match length x frequency) and per DLite cell
(confidence bin x agreement with the lookup), smoothed toward the family's pooled rate; then the
margin (lookup-involving chain over DLite) and the score at which DLite is not run at all, by
simulating the chooser on the logged rounds. Writes the run (JSON), the calibration file and a
PNG of predicted vs actual accepted drafts per source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", nargs="+", default=["stdlib:16", "sharegpt:16", "bfcl:12"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1800)
    p.add_argument("--drafter", default=None, help="DLite checkpoint (default: the shipped one).")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--log", default=None, help="reuse a round log (JSON lines) instead of generating.")
    p.add_argument("--write-calibration", default=None)
    p.add_argument("--plot", default=None)
    return p.parse_args(argv)


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def generate_log(args, log_path):
    import torch
    from tqdm.auto import tqdm

    from dlite_lab.reference.drafters import DLiteEngineDrafter

    from sglang_dlite.model.dlite import load_dlite
    from dlite_lab.reference.engine import ReferenceEngine
    from sglang_dlite.drafting.chooser import Calibration
    from dlite_lab.reference.drafters import HybridEngineDrafter
    from sglang_dlite.model.bundled_target import load_target
    from dlite_lab.training.prompts import load_prompts
    from dlite_lab.workloads.replay import eos_token_ids

    target, tok = load_target("default")
    rounds: list = []
    dr = HybridEngineDrafter(DLiteEngineDrafter(load_dlite(args.drafter, target)), calibration=Calibration(),
                             round_log=rounds)
    eng = ReferenceEngine(target, dr, eos_token_ids(tok, target))
    convs = []
    for spec in args.prompts:
        name, cs = load_prompts(spec, args.seed, 1)
        convs += [(name, c) for c in cs]
    done = set()
    if os.path.exists(log_path):
        with open(log_path) as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    with open(log_path, "a") as f:
        for name, c in tqdm(convs, desc="calibration prompts", unit="prompt"):
            if c["id"] in done:
                continue
            msgs = ([{"role": "system", "content": c["system"]}] if c.get("system") else [])
            msgs.append({"role": "user", "content": c["users"][0]})
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[-args.max_prompt_tokens:]
            rounds.clear()
            with torch.no_grad():
                res = eng.generate(ids, args.max_new_tokens)
            full = ids + res.output_ids
            f.write(json.dumps({"id": c["id"], "source": name, "prompt_len": len(ids), "full": full,
                                "rounds": list(rounds)}) + "\n")
            f.flush()
    eng.close()


def samples(recs, K):
    """Per round: candidate chains with their features and their true accepted lengths."""
    from sglang_dlite.drafting.suffix import LookupStep

    out = []
    for rec in recs:
        full = rec["full"]
        for r in rec["rounds"]:
            truth = full[r["ctx_len"]:r["ctx_len"] + K]
            if len(truth) < K or "dlite" not in r:  # the generation's end: the continuation is cut
                continue
            lk = [LookupStep(*s) for s in r["lookup"]]
            d = [t for t, _ in r["dlite"]]
            q = [c for _, c in r["dlite"]]
            after = [[LookupStep(*s) for s in st] for st in r["after"]]
            out.append({"truth": truth, "lookup": lk, "d": d, "q": q, "after": after, "ctx_len": r["ctx_len"],
                        "source": rec["source"]})
    return out


def fit(rounds):
    from sglang_dlite.drafting.chooser import dlite_key, lookup_key

    lk_cells, dl_cells = {}, {}

    def add(cells, key, ok):
        c = cells.setdefault(key, [0, 0])
        c[0] += int(ok)
        c[1] += 1

    for s in rounds:
        truth, d = s["truth"], s["d"]
        chains = [(0, s["after"][0])] + [(i, s["after"][i]) for i in range(1, len(d)) if d[:i] == truth[:i]]
        for i, steps in chains:
            for j, st in enumerate(steps):
                pos = i + j
                if pos >= len(truth):
                    break
                add(lk_cells, lookup_key(st), st.token == truth[pos])
                if st.token != truth[pos]:
                    break
        for j in range(min(len(d), len(truth))):
            nxt = s["after"][j][0].token if s["after"][j] else None
            agree = 0 if nxt is None else (2 if nxt == d[j] else 1)
            add(dl_cells, dlite_key(s["q"][j], agree), d[j] == truth[j])
            if d[j] != truth[j]:
                break

    def smooth(cells, k=4.0):
        tot = [sum(v[0] for v in cells.values()), sum(v[1] for v in cells.values())]
        pooled = tot[0] / max(tot[1], 1)
        return {key: (a + k * pooled) / (n + k) for key, (a, n) in cells.items()}, pooled

    lk, lk_pooled = smooth(lk_cells)
    dl, dl_pooled = smooth(dl_cells)
    return lk, dl, {"lookup_cells": lk_cells, "dlite_cells": dl_cells, "lookup_pooled": lk_pooled,
                    "dlite_pooled": dl_pooled}


def simulate(rounds, cal, K):
    """The chooser on the logged rounds: tau (``drafting/tau.py`` of the simulated rounds' accepted
    drafts), per-source rounds, calibration pairs."""
    from sglang_dlite.drafting.chooser import expected_accepted
    from sglang_dlite.drafting.tau import tau_of_rounds

    accepted, per_src, pairs, skipped = [], {}, {"suffix": [], "dlite": [], "chosen": []}, 0
    for s in rounds:
        truth, d, q = s["truth"], s["d"], s["q"]
        cands = []
        for i in range(len(d) + 1):
            steps = s["after"][i] if i < len(d) else []
            ps, toks = [], list(d[:i]) + [st.token for st in steps]
            for j in range(i):
                nxt = s["after"][j][0].token if s["after"][j] else None
                agree = 0 if nxt is None else (2 if nxt == d[j] else 1)
                ps.append(cal.p_dlite(q[j], agree))
            ps += [cal.p_lookup(st) for st in steps]
            cands.append((expected_accepted(ps), i, toks))
        lk, dl = cands[0], cands[-1]
        pairs["suffix"].append((lk[0], lcp(lk[2], truth)))
        pairs["dlite"].append((dl[0], lcp(dl[2], truth)))
        if cal.skip_dlite_at is not None and lk[0] >= cal.skip_dlite_at:
            pick, skipped = lk, skipped + 1
        else:
            best_l = max(cands[:-1], key=lambda c: c[0])
            pick = best_l if (best_l[0] >= dl[0] + cal.margin and best_l[2]) else dl
        src = "dlite" if pick is dl else ("suffix" if pick[1] == 0 else "mixed")
        a = lcp(pick[2], truth)
        pairs["chosen"].append((pick[0], a))
        accepted.append(a)
        per_src[src] = per_src.get(src, 0) + 1
    n = max(len(rounds), 1)
    return {"tau": tau_of_rounds(accepted) or 0.0, "rounds": len(rounds), "per_source": per_src,
            "skipped_dlite": skipped / n}, pairs


def plot(pairs, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    styles = {"suffix": ("tab:orange", "s"), "dlite": ("tab:blue", "o"), "chosen": ("tab:green", "^")}
    edges = [0, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 6, 8]
    for name, pts in pairs.items():
        xs, ys, ns = [], [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = [(p, a) for p, a in pts if lo <= p < hi]
            if len(sel) >= 5:
                xs.append(sum(p for p, _ in sel) / len(sel))
                ys.append(sum(a for _, a in sel) / len(sel))
                ns.append(len(sel))
        c, m = styles[name]
        ax.plot(xs, ys, marker=m, color=c, label=f"{name} ({len(pts)} rounds)")
    lim = 7.2
    ax.plot([0, lim], [0, lim], "k--", lw=1, label="perfect calibration")
    ax.set_xlabel("predicted accepted drafts (score)")
    ax.set_ylabel("actual accepted drafts (mean per bin)")
    ax.set_xlim(0, lim)
    ax.set_ylim(0, lim)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.threads))
    from sglang_dlite.drafting.chooser import Calibration

    K = 7
    log_path = args.log or os.path.splitext(args.out)[0] + "_rounds.jsonl"
    t0 = time.perf_counter()
    if not args.log:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        generate_log(args, log_path)
    with open(log_path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    rounds = samples(recs, K)
    lk, dl, cells = fit(rounds)
    prior = simulate(rounds, Calibration(), K)[0]
    best = None
    for margin in (-0.5, -0.25, 0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        cal = Calibration(lookup=lk, dlite=dl, margin=margin)
        res = simulate(rounds, cal, K)[0]
        if best is None or res["tau"] > best[1]["tau"] + 1e-9 or (
                abs(res["tau"] - best[1]["tau"]) <= 1e-9 and abs(margin) < abs(best[0])):
            best = (margin, res)
    margin, tuned = best
    skip, skip_res = None, tuned
    for s in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0):
        res = simulate(rounds, Calibration(lookup=lk, dlite=dl, margin=margin, skip_dlite_at=s), K)[0]
        if res["tau"] >= tuned["tau"] * 0.995:
            skip, skip_res = s, res
            break
    cal = Calibration(lookup=lk, dlite=dl, margin=margin, skip_dlite_at=skip,
                      source=f"bench/lookup_calibration.py on training prompts {' '.join(args.prompts)} "
                             f"(seed {args.seed}, {len(rounds)} rounds)")
    final, pairs = simulate(rounds, cal, K)
    out = {"prompts": args.prompts, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
           "conversations": len(recs), "rounds": len(rounds), "prior": prior, "tuned_margin": margin,
           "tuned": tuned, "skip_dlite_at": skip, "final": final, "calibration": cal.to_dict(), "cells": cells,
           "mean_predicted": {k: sum(p for p, _ in v) / max(len(v), 1) for k, v in pairs.items()},
           "mean_actual": {k: sum(a for _, a in v) / max(len(v), 1) for k, v in pairs.items()},
           "torch_threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t0,
           "argv": sys.argv[1:] if argv is None else list(argv)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.write_calibration:
        with open(args.write_calibration, "w") as f:
            json.dump(cal.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
    if args.plot:
        plot(pairs, args.plot, f"hybrid chooser calibration, training prompts ({len(rounds)} rounds, "
                               f"in-sample)")
    print(f"[calibration] {len(recs)} prompts, {len(rounds)} rounds | simulated tau: prior {prior['tau']:.3f} -> "
          f"tuned {tuned['tau']:.3f} (margin {margin}) -> with skip_dlite_at={skip}: {final['tau']:.3f} "
          f"(DLite skipped in {final['skipped_dlite']:.0%} of rounds) | per source {final['per_source']}")
    for k in pairs:
        print(f"  {k:7s} predicted {out['mean_predicted'][k]:.3f} actual {out['mean_actual'][k]:.3f} accepted/round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
