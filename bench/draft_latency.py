"""Draft-round latency per implementation of the draft-step ops, side by side in one run.

    python bench/draft_latency.py --drafter dlite --impl torch,cpp[,cuda] \
        --batch-sizes 1,8,32 --contexts 512,4096,32768 --out RESULT.json

One *draft round* = what the engine runs per speculation round for a batch of requests: read
each request's newest captured target hidden states out of its context buffer, assemble the round,
the backbone, the low-rank RNN head, the final norm + the batched vocabulary projection, greedy
argmax (``DLiteDrafter.propose``, temperature 0). The context buffer of each request is a
simulated captured-hidden buffer [L, context, H] (DLite reads only its last C positions), so the
round cost must not depend on the context length: the JSON reports the largest/smallest context
ratio per implementation.

Implementations are switched with ``ops.set_ops_mode`` (torch = the reference ops, cpp = the C++
kernels, cuda = the CUDA kernels); ``graph`` (CUDA, DLite) replays the drafter's CUDA graphs
(``sglang_dlite/serving/cuda_graphs.py``, one per batch-size bucket, captured on first use
over the CUDA kernels when built, else the torch ops; the gather of the last C positions stays
eager); measurements interleave implementations round by round so a
noisy shared machine affects them alike; medians are reported. Threads are pinned
(``--threads``, default 1: on a shared 2-core machine more threads measure the neighbours) and
reported. Writes JSON (--out) and a PNG next to it, prints a table.

On a GPU (``--device cuda``) it also times one verify forward of a target (``--verify``, default
on for CUDA: a random-weight Llama of the SmolLM2-135M shape, or ``--verify-config`` JSON of a
transformers LlamaConfig) over K+1 tokens with a KV cache of the context length, and reports the
draft round as a fraction of it.

Adding a drafter (the baselines): add an entry to DRAFTERS — a function (args, device, dtype)
returning an object with ``prepare(batch, context) -> state`` and ``round(state)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_dlite import ops
from dlite_lab.benchmarking.draft_rounds import latency_benches
from sglang_dlite.model.config import DLiteConfig
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.context import context_positions


# ----------------------------------------------------------------------------- drafters
class DLiteBench:
    """DLite with random weights (the round's cost does not depend on the weights' values)."""

    def __init__(self, args, device, dtype):
        overrides = json.loads(args.dlite_config) if args.dlite_config else {}
        self.cfg = cfg = DLiteConfig(**overrides)
        torch.manual_seed(0)
        self.model = DLiteDrafter(cfg).to(device=device, dtype=dtype).eval()
        torch.nn.init.normal_(self.model.head.out_proj.weight, std=0.02)  # a non-identity head
        emb = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device=device, dtype=dtype) * 0.02
        self.model.bind_target(emb, emb)  # tied, like SmolLM2
        self.device, self.dtype = device, dtype
        self.buffers = {}

    def describe(self):
        c = self.cfg
        return (f"DLite H={c.target_hidden_size} V={c.vocab_size} layers={c.num_layers} "
                f"heads={c.num_heads}/{c.num_kv_heads}x{c.head_dim} L={c.num_capture_layers} "
                f"C={c.num_context_positions} K={c.block_size} r={c.rnn_rank} {c.block_attention}")

    def prepare(self, batch, context):
        cfg = self.cfg
        L, C, H = cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size
        if context not in self.buffers:  # one simulated captured-hidden buffer [L, context, H]
            self.buffers[context] = torch.randn(L, context, H, device=self.device, dtype=self.dtype)
        buf = self.buffers[context]
        # request b's newest committed position is context-1-b: it reads positions end-C..end-1
        idx, valid = context_positions([max(context - 1 - b, C) for b in range(batch)], C)  # [B, C], all valid
        idx, valid = idx.to(self.device), valid.to(self.device)
        anchor = torch.randint(0, cfg.vocab_size, (batch,), device=self.device)
        return buf, idx, valid, anchor

    def round(self, state):
        buf, idx, valid, anchor = state
        ctx = buf[:, idx].permute(1, 0, 2, 3)  # [B, L, C, H]: the last C positions of each request
        return self.model.propose(ctx, valid, anchor, temperature=0.0).tokens

    def graph_round(self, state):
        """``--impl graph``: the same round, the drafter replayed from its CUDA graphs."""
        from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs

        buf, idx, valid, anchor = state
        ctx = buf[:, idx].permute(1, 0, 2, 3)
        if getattr(self, "graphs", None) is None or self.graphs.buckets[-1] < ctx.shape[0]:
            self.graphs = DrafterCudaGraphs(self.model, max(ctx.shape[0], self.max_batch), self.device, self.dtype)
        return self.graphs.propose(ctx, valid, anchor)


DRAFTERS = {"dlite": DLiteBench, **latency_benches()}  # + the issue-6 KV baselines: eagle3, dflash, dspark


# ----------------------------------------------------------------------------- verify (GPU)
class VerifyBench:
    """One target verify forward over K+1 tokens with a KV cache of `context` positions."""

    def __init__(self, args, device, dtype, block_size):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=65536,
                   tie_word_embeddings=True)
        if args.verify_config:
            cfg.update(json.loads(args.verify_config))
        self.config = LlamaConfig(**cfg)
        self.model = LlamaForCausalLM(self.config).to(device=device, dtype=dtype).eval()
        self.device, self.dtype, self.k = device, dtype, block_size

    def prepare(self, batch, context):
        from transformers import DynamicCache

        c = self.config
        hd = c.hidden_size // c.num_attention_heads
        cache = DynamicCache()
        for layer in range(c.num_hidden_layers):
            kv = torch.randn(batch, c.num_key_value_heads, context, hd, device=self.device, dtype=self.dtype)
            cache.update(kv, kv.clone(), layer)
        ids = torch.randint(0, c.vocab_size, (batch, self.k + 1), device=self.device)
        pos = torch.arange(context, context + self.k + 1, device=self.device)[None].expand(batch, -1)
        return cache, ids, pos

    def round(self, state):
        cache, ids, pos = state
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        cache.crop(-(self.k + 1))
        return out.logits


# ----------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def set_impl(impl):
    ops.set_ops_mode("auto" if impl == "graph" else impl)  # graphs are captured over auto's pick


def time_rounds(runners, reps, warmup, device):
    """runners: {key: (setup, fn, state)}. Interleaved round by round; returns {key: [ms, ...]}."""
    for _ in range(warmup):
        for name, (setup, fn, state) in runners.items():
            setup()
            fn(state)
    sync(device)
    times = {name: [] for name in runners}
    for _ in range(reps):
        for name, (setup, fn, state) in runners.items():
            setup()
            sync(device)
            t0 = time.perf_counter()
            fn(state)
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description="Draft-round latency per implementation (see module doc).")
    ap.add_argument("--drafter", default="dlite", help=f"comma list of {sorted(DRAFTERS)}")
    ap.add_argument("--impl", default="torch,cpp", help="comma list of torch, cpp, cuda")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if --impl has cuda)")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned, reported)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dlite-config", default=None, help="JSON of DLiteConfig overrides (default: SmolLM2-135M drafter)")
    ap.add_argument("--verify", default=None, choices=["on", "off"], help="time a target verify round (default: on for CUDA)")
    ap.add_argument("--verify-config", default=None, help="JSON of LlamaConfig overrides for the verify target")
    ap.add_argument("--out", default="artifacts/bench/draft_latency.json")
    ap.add_argument("--png", default=None, help="default: the --out path with .png")
    args = ap.parse_args(argv)

    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    drafters = [s.strip() for s in args.drafter.split(",") if s.strip()]
    for d in drafters:
        if d not in DRAFTERS:
            ap.error(f"unknown drafter {d!r}; known: {sorted(DRAFTERS)}")
    for i in impls:
        if i not in ("torch", "cpp", "cuda", "graph"):
            ap.error(f"unknown impl {i!r}; use torch, cpp, cuda, graph")
    device = torch.device(args.device or ("cuda" if {"cuda", "graph"} & set(impls) else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda but torch {torch.__version__} sees no CUDA device")
    if device.type == "cuda" and "cpp" in impls:
        ap.error("cpp runs on CPU tensors; benchmark it with --device cpu")
    if "graph" in impls and (device.type != "cuda" or drafters != ["dlite"]):
        ap.error("graph replays the DLite drafter's CUDA graphs: --device cuda --drafter dlite")
    avail = ops.available_impls()
    missing = [i for i in impls if i not in avail and i != "graph"]
    if missing:
        ap.error(f"impl(s) {missing} unavailable here (available: {avail}); {ops.build_status()}")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    do_verify = (args.verify == "on") if args.verify else device.type == "cuda"

    env = {
        "torch": torch.__version__, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "loadavg_start": os.getloadavg(), "ops": ops.build_status(),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
    }
    print(f"# threads={env['threads']} device={device} dtype={env['dtype']} loadavg={env['loadavg_start']}")
    print(f"# {env['ops']}")
    results = []
    for dname in drafters:
        bench = DRAFTERS[dname](args, device, dtype)
        bench.max_batch = max(batches)  # the largest CUDA-graph bucket (--impl graph)
        print(f"# {dname}: {bench.describe()}")
        verify = VerifyBench(args, device, dtype, bench.cfg.block_size) if do_verify else None
        for B in batches:
            # every (implementation, context) of one batch size is timed in one interleaved loop,
            # so load changes on a shared machine hit all of them alike
            states = {ctx: bench.prepare(B, ctx) for ctx in contexts}
            fns = {i: bench.graph_round if i == "graph" else bench.round for i in impls}
            runners = {(i, ctx): ((lambda i=i: set_impl(i)), fns[i], states[ctx]) for ctx in contexts for i in impls}
            agree = {}
            for ctx in contexts:  # same tokens from every implementation (greedy; near-ties aside)
                toks = {}
                for i in impls:
                    set_impl(i)
                    toks[i] = fns[i](states[ctx]).cpu()
                agree[ctx] = {i: float((toks[i] == toks[impls[0]]).float().mean()) for i in impls}
            times = time_rounds(runners, args.reps, args.warmup, device)
            for ctx in contexts:
                row = {"drafter": dname, "batch": B, "context": ctx,
                       "ms": {i: statistics.median(times[(i, ctx)]) for i in impls},
                       "ms_min": {i: min(times[(i, ctx)]) for i in impls},
                       "token_agreement_vs_" + impls[0]: agree[ctx]}
                if verify is not None:
                    vstate = verify.prepare(B, ctx)
                    vt = time_rounds({"verify": ((lambda: None), verify.round, vstate)}, max(5, args.reps // 2), 2, device)
                    row["verify_ms"] = statistics.median(vt["verify"])
                    row["draft_fraction_of_verify"] = {i: row["ms"][i] / row["verify_ms"] for i in impls}
                    del vstate
                results.append(row)
                extra = f" verify {row['verify_ms']:.2f} ms" if verify is not None else ""
                print(f"{dname:6s} B={B:3d} ctx={ctx:6d} " + " ".join(f"{i}={row['ms'][i]:8.2f} ms" for i in impls) + extra, flush=True)
            del states
        del bench
    set_impl("auto")
    env["loadavg_end"] = os.getloadavg()

    # summary: speed-ups vs torch and context ratios
    summary = {"speedup_vs_torch": {}, "context_ratio": {}}
    for r in results:
        if "torch" in r["ms"]:
            for i in impls:
                if i != "torch":
                    summary["speedup_vs_torch"].setdefault(f"{r['drafter']}/{i}", {})[f"B={r['batch']},ctx={r['context']}"] = r["ms"]["torch"] / r["ms"][i]
    lo, hi = min(contexts), max(contexts)
    for dname in drafters:
        for B in batches:
            rl = next(r for r in results if r["drafter"] == dname and r["batch"] == B and r["context"] == lo)
            rh = next(r for r in results if r["drafter"] == dname and r["batch"] == B and r["context"] == hi)
            for i in impls:
                summary["context_ratio"].setdefault(f"{dname}/{i}", {})[f"B={B}: {hi}/{lo}"] = rh["ms"][i] / rl["ms"][i]
                summary.setdefault("context_ratio_of_min", {}).setdefault(f"{dname}/{i}", {})[f"B={B}: {hi}/{lo}"] = rh["ms_min"][i] / rl["ms_min"][i]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "results": results, "summary": summary}, indent=2))
    print_table(results, impls, contexts, batches, drafters, summary)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    try:
        plot(results, impls, contexts, batches, drafters, env, png)
        print(f"# wrote {out} and {png}")
    except ImportError:
        print(f"# wrote {out} (matplotlib missing: no PNG)")
    return 0


def print_table(results, impls, contexts, batches, drafters, summary):
    print()
    head = "| drafter | batch | context | " + " | ".join(f"{i} ms" for i in impls)
    head += "".join(f" | {i} speed-up" for i in impls if i != "torch" and "torch" in impls)
    if any("verify_ms" in r for r in results):
        head += " | verify ms | " + " | ".join(f"{i} / verify" for i in impls)
    print(head + " |")
    print("|" + "---|" * (head.count("|") + 1 - 1))
    for r in results:
        line = f"| {r['drafter']} | {r['batch']} | {r['context']} | " + " | ".join(f"{r['ms'][i]:.2f}" for i in impls)
        line += "".join(f" | {r['ms']['torch'] / r['ms'][i]:.2f}x" for i in impls if i != "torch" and "torch" in impls)
        if "verify_ms" in r:
            line += f" | {r['verify_ms']:.2f} | " + " | ".join(f"{r['draft_fraction_of_verify'][i]:.3f}" for i in impls)
        print(line + " |")
    print()
    for k, v in summary["context_ratio"].items():
        print(f"context ratio {k}: " + ", ".join(f"{kk} = {vv:.3f}" for kk, vv in v.items()))


def plot(results, impls, contexts, batches, drafters, env, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(drafters), figsize=(6 * len(drafters), 4.2), squeeze=False)
    for ax, dname in zip(axes[0], drafters):
        for i in impls:
            for ctx in contexts:
                ys = [next(r["ms"][i] for r in results if r["drafter"] == dname and r["batch"] == B and r["context"] == ctx) for B in batches]
                ax.plot(batches, ys, marker="o", label=f"{i}, ctx {ctx}", linestyle="-" if ctx == contexts[0] else "--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per draft round")
        ax.set_title(f"{dname}: {env['device']} {env['dtype']}, {env['threads']} thread(s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
