"""Regeneration throughput: target-generated tokens/s of ``gen-data``'s engines, side by side.

    nice .venv/bin/python bench/gen_throughput.py                       # hf vs fast fp32 vs fast+spec
    nice .venv/bin/python bench/gen_throughput.py --engines hf fast-fp32 fast-spec sglang   # + sglang's engine
    nice .venv/bin/python bench/gen_throughput.py --engines hf fast-fp32 --prompts sharegpt:4 stdlib:4

Engines: ``hf`` (gen-data --engine hf), ``fast-fp32`` / ``fast-bf16`` (the fast loop, one token per
step), ``fast-spec`` (the fast loop verifying suffix-lookup drafts, gen-data's default; its weights
MKL-packed, its decode/verify attention the C++ ``kv_cache_attention`` kernel when built),
``fast-spec-unpacked`` (the same with plain ``x @ W.T``: the packing's A/B), ``fast-spec-sdpa`` (the
same with chunked SDPA attention: the kernel's A/B), ``sglang``
(sglang's offline engine + the float32 feature pass; its CPU time includes the engine's
subprocesses, its start-up is reported apart). Per engine also the prompt tokens and, for the fast
engines, the CPU share of prefill (which no decoding speed-up shortens).

Every engine regenerates the same fixed conversations (``--prompts``, the gen-data prompt sources
with ``--seed``; greedy, features of ``--capture-layers`` captured as gen-data does) on
``--threads`` torch threads (default 1, pinned and reported). Reported per engine: generated
tokens, wall and CPU seconds, tokens/s on both clocks (CPU time is the fair one on a shared
machine) and the speed-up over the first engine; and exactness against the float32 target: one
teacher-forced float32 HF forward over every finished sequence gives the target's greedy choice at
every position, and we count the generated tokens that are not it, the sequences with at least one
(``cut`` by ``fast_regen.relabel``) and the generated tokens the cut rule would drop; the
captured features are compared with that forward's hidden states. JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

ENGINES = ("hf", "fast-fp32", "fast-bf16", "fast-spec", "fast-spec-unpacked", "fast-spec-sdpa", "sglang")
DEFAULT_ENGINES = ("hf", "fast-fp32", "fast-spec")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--prompts", nargs="+", default=["sharegpt:6", "bfcl:4", "stdlib:6"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--capture-layers", default="2,15,27")
    ap.add_argument("--batch-size", type=int, default=16, help="fast engine: KV-cache slots (conversations decoded at once)")
    ap.add_argument("--shard-size", type=int, default=12,
                    help="hf engine: conversations per generate batch, as gen-data --engine hf batches a shard "
                         "(12 = the shipped recipe's gen-data --shard-size); the fast engine streams them all")
    ap.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES), choices=ENGINES)
    ap.add_argument("--spec-drafts", type=int, default=4, help="fast-spec: max suffix-lookup drafts verified per row and step")
    ap.add_argument("--min-reach", type=float, default=0.3,
                    help="fast-spec: a row's drafts stop where the calibrated chance of reaching them drops below this")
    ap.add_argument("--spec-batch-size", type=int, default=None, help="fast-spec: KV-cache slots (default --batch-size)")
    ap.add_argument("--spec-fixed-rows", type=float, default=None,
                    help="fast-spec: a step's fixed cost in verified rows (default: spec_regen.FIXED_ROWS of the engine's attention path; < 0: verify every candidate)")
    ap.add_argument("--sglang-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--sglang-batch-size", type=int, default=None, help="sglang: max running requests (default --batch-size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="artifacts/results/gen_throughput.json")
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm

    from sglang_dlite import ops
    from sglang_dlite.model.bundled_target import load_target
    from dlite_lab.training.exactness import count_disagreements, first_disagreement, reference_greedy
    from dlite_lab.training.fast_regen import FastRegenerator
    from dlite_lab.training.hf_regen import Regenerator
    from dlite_lab.training.prompts import load_prompts
    from sglang_dlite.model.bundled_target import resolve_target
    from dlite_lab.training.sglang_regen import SglangRegenerator, process_tree_cpu_seconds
    from dlite_lab.training.spec_regen import SpecRegenerator
    from dlite_lab.training.turns import TurnRules

    torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.capture_layers.split(",")] if args.capture_layers else None
    model, tok = load_target(args.target)
    turns = TurnRules(tok, model, args.max_new_tokens, args.max_len)
    convs, sources = [], {}
    for spec in args.prompts:
        name, cs = load_prompts(spec, args.seed, args.max_turns)
        convs += cs
        sources[name] = len(cs)
    print(f"gen_throughput: {len(convs)} conversations {sources}, max_new_tokens {args.max_new_tokens}, "
          f"max_turns {args.max_turns}, torch threads {torch.get_num_threads()}")
    results = {}
    for name in tqdm(args.engines, desc="engines", unit="engine"):
        if name == "hf":
            gen = Regenerator(model, turns, capture_layers=layers)
        elif name.startswith("fast-spec"):  # A/Bs: -unpacked plain x @ W.T, -sdpa chunked SDPA attention
            gen = SpecRegenerator(model, turns, capture_layers=layers,
                                  packed=name != "fast-spec-unpacked",
                                  attention="sdpa" if name == "fast-spec-sdpa" else "auto",
                                  batch_size=args.spec_batch_size or args.batch_size, num_drafts=args.spec_drafts,
                                  min_reach=args.min_reach,
                                  **({} if args.spec_fixed_rows is None else {"fixed_rows": args.spec_fixed_rows}))
        elif name == "sglang":
            s0, sc0 = time.time(), process_tree_cpu_seconds()
            gen = SglangRegenerator(resolve_target(args.target), model, turns, capture_layers=layers,
                                    batch_size=args.sglang_batch_size or args.batch_size, dtype=args.sglang_dtype,
                                    threads=args.threads)
            startup = {"startup_wall_s": round(time.time() - s0, 1), "startup_cpu_s": round(process_tree_cpu_seconds() - sc0, 1)}
        else:
            dt = torch.float32 if name == "fast-fp32" else torch.bfloat16
            gen = FastRegenerator(model, turns, capture_layers=layers, batch_size=args.batch_size, dtype=dt)
        w0, c0 = time.time(), (time.process_time() if name != "sglang" else process_tree_cpu_seconds())
        if name == "hf":  # gen-data's hf engine: one Regenerator.run per shard
            seqs, masks, feats = [], [], []
            for k in range(0, len(convs), args.shard_size):
                a, b, c = gen.run(convs[k:k + args.shard_size])
                seqs, masks, feats = seqs + a, masks + b, feats + list(c)
        else:
            seqs, masks, feats = gen.run(convs)
        wall, cpu = time.time() - w0, (time.process_time() if name != "sglang" else process_tree_cpu_seconds()) - c0
        if name in ("hf", "sglang"):
            gen.close()
        n_gen = int(sum(sum(m) for m in masks))
        results[name] = {"seqs": seqs, "masks": masks, "feats": feats, "wall_s": wall, "cpu_s": cpu, "generated_tokens": n_gen}
        results[name]["prompt_tokens"] = int(sum(len(m) - sum(m) for m in masks))
        if hasattr(gen, "prefill_cpu_s"):
            results[name]["prefill"] = {"cpu_s": round(gen.prefill_cpu_s, 2), "tokens": gen.prefill_tokens,
                                        "share_of_cpu": round(gen.prefill_cpu_s / cpu, 3)}
            print(f"  {name}: prefill {results[name]['prefill']}")
        if hasattr(gen, "engine"):  # the fast engines: which attention path ran
            results[name]["attention"] = "kernel" if gen.engine.kernel_attention else "sdpa"
        if hasattr(gen, "summary"):
            results[name]["spec"] = gen.summary()
            print(f"  {name}: {results[name]['spec']}")
        if name == "sglang":
            results[name]["engine_info"] = dict(startup, dtype=args.sglang_dtype, **{
                k: round(v, 1) if isinstance(v, float) else v for k, v in gen.stats.items()},
                note="wall/CPU exclude the engine start-up; CPU = this process + the engine's subprocesses; "
                     "includes the float32 HF feature pass")
            print(f"  {name}: {results[name]['engine_info']}")
        print(f"  {name}: {n_gen} generated tokens, {wall:.1f} s wall ({n_gen / wall:.1f} tok/s), "
              f"{cpu:.1f} s CPU ({n_gen / cpu:.1f} tok/CPU-s)", flush=True)
        del gen

    # exactness: the float32 target's teacher-forced greedy choice at every position
    rows = []
    base = args.engines[0]
    for name in tqdm(args.engines, desc="fp32 reference", unit="engine"):
        r = results[name]
        preds, rfeats = reference_greedy(model, r["seqs"], layers)
        dis = [count_disagreements(s, m, p) for s, m, p in zip(r["seqs"], r["masks"], preds)]
        dropped = 0
        for s, m, p in zip(r["seqs"], r["masks"], preds):
            j = first_disagreement(s, m, p)
            if j is not None:
                dropped += int(sum(m[j:])) - 1
        fdiff, frel = 0.0, 0.0
        if layers:
            for f, g in zip(r["feats"], rfeats):
                if f is None or len(f) == 0:
                    continue
                f = torch.as_tensor(f).float()
                g = g[: len(f)].float()
                d = (f - g).abs()
                fdiff = max(fdiff, float(d.max()))
                frel = max(frel, float((d / g.abs().clamp(min=1.0)).max()))
        same_as_base = sum(int(a == b) for a, b in zip(r["seqs"], results[base]["seqs"]))
        row = {
            "engine": name, "generated_tokens": r["generated_tokens"], "wall_s": round(r["wall_s"], 2),
            "cpu_s": round(r["cpu_s"], 2), "tok_per_s": round(r["generated_tokens"] / r["wall_s"], 2),
            "tok_per_cpu_s": round(r["generated_tokens"] / r["cpu_s"], 2),
            "tokens_not_fp32_greedy": int(sum(dis)), "sequences_cut": int(sum(d > 0 for d in dis)),
            "tokens_dropped_by_cut": int(dropped), "sequences_identical_to_" + base: same_as_base,
            "feature_max_abs_diff": round(fdiff, 4), "feature_max_rel_diff": round(frel, 5),
        }
        for k in ("spec", "engine_info", "prefill", "prompt_tokens", "attention"):
            if k in r:
                row[k] = r[k]
        rows.append(row)
    b = rows[0]
    for row in rows:
        row["speedup_wall"] = round(row["tok_per_s"] / b["tok_per_s"], 2)
        row["speedup_cpu"] = round(row["tok_per_cpu_s"] / b["tok_per_cpu_s"], 2)
    out = {
        "config": {k: v for k, v in vars(args).items()}, "sources": sources, "conversations": len(convs),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(), "ops": ops.build_status(), "rows": rows,
        "exactness_reference": "teacher-forced float32 HF forward over each finished sequence (argmax at every position)",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    hdr = f"{'engine':<10} {'gen tok':>8} {'wall s':>8} {'tok/s':>7} {'CPU s':>8} {'tok/CPU-s':>9} {'x wall':>7} {'x CPU':>6} {'not-greedy':>10} {'cut seqs':>8} {'dropped':>7} {'same as ' + base:>14} {'feat rel':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['engine']:<10} {r['generated_tokens']:>8} {r['wall_s']:>8.1f} {r['tok_per_s']:>7.1f} {r['cpu_s']:>8.1f} "
              f"{r['tok_per_cpu_s']:>9.1f} {r['speedup_wall']:>7.2f} {r['speedup_cpu']:>6.2f} {r['tokens_not_fp32_greedy']:>10} "
              f"{r['sequences_cut']:>8} {r['tokens_dropped_by_cut']:>7} {r['sequences_identical_to_' + base]:>9}/{len(convs):<4} "
              f"{r['feature_max_rel_diff']:>8.4f}")
    print(f"-> {args.out} (torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
