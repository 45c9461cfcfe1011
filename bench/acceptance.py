#!/usr/bin/env python
"""Acceptance harness: replay a workload through the speculative engine and the target alone.

    python bench/acceptance.py --engine reference --drafter dlite[:PATH] --workload NAME|FILE \
        --max-convs N --max-new-tokens M [--temperature T] [--check-lossless] --out RESULT.json

Writes (atomically) a JSON with tau, tau_by_context (by the context length at each round:
0-1k, 1-2k, 2-4k, 4-8k), per_position_accept (P[draft i accepted], K values), rounds,
source_share / by_source / source_share_by_context (hybrid and suffix: the share of rounds each
drafting source made, their tau, predicted vs actual accepted drafts),
generated_tokens, draft/verify ms per round, spec_tokens_per_s and ar_tokens_per_s (generated
tokens over prefill + decode time, same turns, target alone for ar), lossless_checked,
lossless_mismatches, torch_threads, ... and prints a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings



def parse_args(argv=None):
    from dlite_lab.workloads import BUILTIN_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="reference", choices=["reference"],
                   help="reference: the HF speculative engine (dlite_lab.reference.engine).")
    p.add_argument("--drafter", default="dlite",
                   help="dlite[:PATH] (shipped default / random), hybrid[:PATH] (DLite + suffix lookup, one "
                        "token tree per round: what DLITE serves), hybrid-chain[:PATH] (one chain per round), "
                        "hybrid@nodes=N,branching=head|chain / dlite-tree / suffix-tree[@N], suffix (the lookup alone), dlite-online / hybrid-online / "
                        "hybrid-chain-online[@OPTS] (learning from verify results), a baseline name (ngram, eagle3[:PATH], ...), or a "
                        "checkpoint folder (its config.json's model_type picks the drafter).")
    p.add_argument("--target", default="default", help="target checkpoint folder, or 'default' (SmolLM2-135M-Instruct).")
    p.add_argument("--workload", required=True, help=f"one of {', '.join(BUILTIN_WORKLOADS)}, or a .jsonl file.")
    p.add_argument("--max-convs", type=int, default=None, help="first N conversations (default: all).")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="skip turns with longer prompts (default: target limit - max-new-tokens).")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-lossless", action="store_true",
                   help="greedy only: compare speculative and target-alone outputs token for token.")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (reported in the JSON).")
    p.add_argument("--out", required=True, help="result JSON path.")
    p.add_argument("--ar-cache", default=None,
                   help="JSON-lines file of target-alone turn results shared between runs (the baseline "
                        "does not depend on the drafter): later drafters reuse its outputs and timings.")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def write_json_atomic(path: str, obj: dict):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def summary_line(r: dict) -> str:
    ctx = " ".join(f"{k}:{_fmt(v)}({r['rounds_by_context'].get(k, 0)})" for k, v in r["tau_by_context"].items())
    ll = (f"{r['lossless_mismatches']}/{r['lossless_compared_turns']} turns mismatched" if r["lossless_checked"]
          else "not checked")
    return (f"[acceptance] {r['workload']} drafter={r['drafter']} convs={r['conversations']} turns={r['turns']}"
            f" (skipped {r['skipped_turns']}) rounds={r['rounds']} tau={_fmt(r['tau'], '.3f')} by-ctx[{ctx}]"
            f" spec={_fmt(r['spec_tokens_per_s'], '.1f')} tok/s ar={_fmt(r['ar_tokens_per_s'], '.1f')} tok/s"
            f" speedup={_fmt(r['speedup'])}x draft={_fmt(r['draft_ms_per_round'], '.1f')}ms"
            f" verify={_fmt(r['verify_ms_per_round'], '.1f')}ms/round lossless: {ll} threads={r['torch_threads']}"
            + ("" if not r.get("source_share") else " sources[" + " ".join(
                f"{k}:{v:.0%}" for k, v in sorted(r["source_share"].items())) + "]"))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.threads))
    from dlite_lab.registry import make_engine_drafter
    from dlite_lab.reference.engine import ReferenceEngine
    from sglang_dlite.errors import DLiteError
    from sglang_dlite.model.bundled_target import load_target
    from dlite_lab.workloads import load_workload
    from dlite_lab.workloads.replay import eos_token_ids, replay

    try:
        convs = load_workload(args.workload, max_convs=args.max_convs)
        t0 = time.perf_counter()
        target, tok = load_target(args.target)
        load_s = time.perf_counter() - t0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            drafter = make_engine_drafter(args.drafter, target)
        drafter_warnings = [str(w.message) for w in caught]
        for w in drafter_warnings:
            print(f"warning: {w}", file=sys.stderr)
        engine = ReferenceEngine(target, drafter, eos_token_ids=eos_token_ids(tok, target))
        greedy = args.temperature <= 0
        from dlite_lab.workloads.replay import ARCache

        ar_cache = ARCache(args.ar_cache, getattr(target.config, "_name_or_path", args.target)) if args.ar_cache else None
        stats = replay(engine, tok, convs, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, speculative=True, autoregressive=True,
                       check_lossless=args.check_lossless and greedy, max_context_tokens=args.max_context_tokens,
                       progress=not args.no_progress, desc=args.workload, ar_cache=ar_cache)
        engine.close()
    except DLiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    r = {"workload": args.workload, "engine": args.engine, "drafter": args.drafter, "target": args.target,
         "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
         "seed": args.seed}
    r.update(stats.to_dict())
    r["per_turn"] = stats.per_turn
    if args.check_lossless and not greedy:
        r["lossless_checked"] = False
        r["lossless_mismatches"] = None
        r["lossless_note"] = ("not applicable at temperature > 0: the sampled outputs differ by design; "
                              "losslessness there is distributional (rejection sampling), not token-for-token.")
    else:
        r["lossless_checked"] = bool(args.check_lossless)
        if not args.check_lossless:
            r["lossless_mismatches"] = None
    r["ar_cached_turns"] = ar_cache.hits if ar_cache else 0
    if callable(getattr(drafter, "stats", None)):  # online drafters: updates, reverts, learning ms per round
        r["drafter_stats"] = drafter.stats()
    r.update({"torch_threads": torch.get_num_threads(), "target_load_s": load_s,
              "drafter_warnings": drafter_warnings, "torch_version": torch.__version__,
              "python": platform.python_version(), "argv": sys.argv[1:] if argv is None else list(argv)})
    write_json_atomic(args.out, r)
    print(summary_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
