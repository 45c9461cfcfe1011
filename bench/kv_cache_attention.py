"""The fast regeneration engine's decode / verify step: C++ ``kv_cache_attention`` vs chunked SDPA.

    python bench/kv_cache_attention.py [--slots 32] [--contexts 300 900] [--lens 1 2 3 5] [--out FILE]

Times ``FastLlama.verify`` (training/fast_llama.py) on a random Llama with SmolLM2-135M's attention
shapes (hidden 576, 9 query heads, 3 KV heads, head_dim 64) and tiny MLPs: a step is its attention plus
the QKV/O projections and element-wise work, the same in both paths. Every slot's static fp32 KV cache
is filled to a context drawn from ``--contexts``; rows of 1..L new tokens.
Both paths run the same inputs one after the other per row length (best of ``--repeats``); the
outputs are compared. Reports ms per step, the ratio, and the KV bytes per second of kernel-path
step time (a lower bound on the kernel's own rate). JSON to ``--out``; torch threads pinned (``--threads``, default 1) and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs=2, default=(300, 900), metavar=("MIN", "MAX"))
    ap.add_argument("--lens", type=int, nargs="+", default=[1, 2, 3, 5], help="max new tokens per row (rows draw 1..L)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="artifacts/results/kv_cache_attention.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_dlite import ops
    from dlite_lab.training.fast_llama import FastLlama

    if not ops.kv_cache_attention_kernel_available(torch.float32, 64):
        raise SystemExit(f"the C++ kv_cache_attention kernel is not available ({ops.build_status()}); run `make build-ext`.")
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=args.layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    max_len = args.contexts[1] + max(args.lens) + 1
    engines = {a: FastLlama(model, args.slots, max_len, attention=a) for a in ("kernel", "sdpa")}
    kv = torch.randn_like(engines["kernel"].k)
    for e in engines.values():
        e.k.copy_(kv)
        e.v.copy_(kv.flip(-1))
        e.hw = [max_len] * args.slots
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.sort(torch.randint(args.contexts[0], args.contexts[1], (args.slots,), generator=g)).values.tolist()
    rows = []
    for L in args.lens:
        lens = torch.randint(1, L + 1, (args.slots,), generator=g).tolist()
        ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
        res, outs = {}, {}
        for name, e in engines.items():
            outs[name] = e.verify(ids, starts, lens, False)[0]
            best = float("inf")
            for _ in range(args.repeats):
                t = time.perf_counter()
                e.verify(ids, starts, lens, False)
                best = min(best, time.perf_counter() - t)
            res[name] = best * 1e3
        kv_bytes = sum(s + n for s, n in zip(starts, lens)) * cfg.num_key_value_heads * 64 * 4 * 2 * args.layers
        rows.append({"max_len_per_row": L, "rows": sum(lens), "kernel_ms": round(res["kernel"], 3),
                     "sdpa_ms": round(res["sdpa"], 3), "speedup": round(res["sdpa"] / res["kernel"], 2),
                     "kernel_kv_GBps": round(kv_bytes / res["kernel"] / 1e6, 2),
                     "max_abs_diff": float((outs["kernel"] - outs["sdpa"]).abs().max())})
    out = {"config": vars(args), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "ops": ops.build_status(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'lens<=':>6} {'rows':>5} {'kernel ms':>10} {'sdpa ms':>9} {'x':>5} {'kernel GB/s':>11} {'max diff':>9}")
    for r in rows:
        print(f"{r['max_len_per_row']:>6} {r['rows']:>5} {r['kernel_ms']:>10.2f} {r['sdpa_ms']:>9.2f} {r['speedup']:>5.2f} "
              f"{r['kernel_kv_GBps']:>11.2f} {r['max_abs_diff']:>9.1e}")
    print(f"-> {args.out} (torch threads {torch.get_num_threads()}, {args.slots} slots, {args.layers} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
