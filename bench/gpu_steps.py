"""The Python steps of ``bench/gpu_check.py`` that need no sglang, one subcommand each; each writes
one JSON record (``--out``) with ``"ok"`` and what it measured, and exits 0 only when ok.

    python bench/gpu_steps.py probe  --out probe.json     # versions, the GPU and its limits (any machine)
    python bench/gpu_steps.py graphs --out graphs.json    # drafter CUDA graphs == eager, bitwise (CUDA)
    python bench/gpu_steps.py engine --out engine.json    # reference engine on CUDA, float32, CUDA ops:
                                                          # greedy output == the target's (--device cpu works too)

``graphs``: a random SmolLM2-sized DLite drafter (float32 and bfloat16) captured in CUDA graphs
(``sglang_dlite/serving/cuda_graphs.py``, which imports no sglang) for batch sizes up to 32;
at every bucket size the replayed tokens (and confidences, the hybrid drafting variant) must be
bitwise equal to an eager ``propose`` of the same inputs through the same ops. ``engine``: a tiny
random Llama target and a random DLite drafter in the reference engine on the device, greedy output
== the target's own HF ``generate``, also with a drafter that proposes the target's continuation
(whole blocks accepted, KV rolled back on the device), plus one sampled run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "sglang",
                 "flashinfer-python", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def probe(args) -> dict:
    import torch

    rec = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "versions": _versions(), "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    try:
        rec["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if rec["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        rec["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
                      "memory_gb": round(p.total_memory / 2**30, 1),
                      "l2_cache_mb": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
                      "shared_memory_per_block_optin": getattr(p, "shared_memory_per_block_optin", None),
                      "shared_memory_per_multiprocessor": getattr(p, "shared_memory_per_multiprocessor", None)}
        rec["cudnn"] = torch.backends.cudnn.version()
    rec["ok"] = True
    return rec


def graphs(args) -> dict:
    import torch

    from sglang_dlite import ops
    from sglang_dlite.model.config import DLiteConfig
    from sglang_dlite.model.dlite import DLiteDrafter
    from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs

    if not torch.cuda.is_available():
        return {"ok": False, "error": "no CUDA device"}
    dev = torch.device("cuda")
    rec = {"ops": ops.build_status(), "max_bs": args.max_bs, "dtypes": {}}
    ok = True
    for dname in ("float32", "bfloat16"):
        dtype = getattr(torch, dname)
        torch.manual_seed(0)
        cfg = DLiteConfig()
        model = DLiteDrafter(cfg).to(device=dev, dtype=dtype).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        torch.nn.init.normal_(model.head.out_proj.weight, std=0.02)  # a non-identity head
        emb = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device=dev, dtype=dtype) * 0.02
        model.bind_target(emb, emb)
        L, C, H = cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size
        per = {}
        t0 = time.time()
        g_tok = DrafterCudaGraphs(model, args.max_bs, dev, dtype)
        g_conf = DrafterCudaGraphs(model, args.max_bs, dev, dtype, with_confidence=True)
        capture_s = time.time() - t0
        gen = torch.Generator(device=dev).manual_seed(1)
        impls = {}
        for bs in g_tok.buckets:
            ctx = torch.randn(bs, L, C, H, device=dev, dtype=dtype, generator=gen)
            valid = torch.rand(bs, C, device=dev, generator=gen) < 0.8
            valid[:, -1] = True
            valid[0, :-1] = False  # one request at the start of its sequence: only its newest slot
            anchor = torch.randint(0, cfg.vocab_size, (bs,), device=dev, generator=gen)
            eager = model.propose(ctx, valid, anchor)
            impls = {op: ops.last_impl(op) for op in ("assemble_round_inputs", "round_attention",
                                                      "lowrank_rnn_scan", "lm_head_argmax")}
            eager_c = model.propose(ctx, valid, anchor, return_confidence=True)
            toks = g_tok.propose(ctx, valid, anchor).clone()
            toks2 = g_tok.propose(ctx, valid, anchor).clone()
            ctoks, conf = (x.clone() for x in g_conf.propose(ctx, valid, anchor))
            row = {"tokens_equal": bool(torch.equal(toks, eager.tokens)),
                   "replay_repeatable": bool(torch.equal(toks, toks2)),
                   "confidence_tokens_equal": bool(torch.equal(ctoks, eager_c.tokens)),
                   "confidence_equal": bool(torch.equal(conf, eager_c.confidence))}
            per[bs] = row
            ok = ok and all(row.values())
        # a batch between buckets runs padded in the next bucket: the same tokens up to GEMM rounding
        # (informational: eager at batch 3 and the graph of batch 4 may pick other GEMM kernels)
        bs = 3 if 4 in g_tok.buckets else None
        padded = None
        if bs:
            ctx = torch.randn(bs, L, C, H, device=dev, dtype=dtype, generator=gen)
            valid = torch.ones(bs, C, dtype=torch.bool, device=dev)
            anchor = torch.randint(0, cfg.vocab_size, (bs,), device=dev, generator=gen)
            padded = float((g_tok.propose(ctx, valid, anchor) == model.propose(ctx, valid, anchor).tokens)
                           .float().mean())
        rec["dtypes"][dname] = {"buckets": g_tok.buckets, "capture_s": round(capture_s, 2), "per_bucket": per,
                                "impl": impls, "padded_batch3_token_agreement": padded}
        del g_tok, g_conf, model
        torch.cuda.empty_cache()
    rec["cuda_ops_required"] = args.require_cuda_ops
    if args.require_cuda_ops:  # the graphs must have captured the CUDA kernels, not the torch ops
        used = {v for r in rec["dtypes"].values() for v in r["impl"].values()}
        rec["cuda_ops_used"] = used == {"cuda"}
        ok = ok and rec["cuda_ops_used"]
    rec["ok"] = ok
    return rec


def engine(args) -> dict:
    import random

    import torch

    from sglang_dlite import ops
    from dlite_lab.benchmarking.random_models import tiny_llama
    from sglang_dlite.model.config import DLiteConfig
    from dlite_lab.reference.drafters import DLiteEngineDrafter, OracleDrafter
    from dlite_lab.reference.engine import ReferenceEngine
    from sglang_dlite.model.dlite import DLiteDrafter
    from sglang_dlite.drafting.tau import tau_of_requests

    def _rounded(x):
        return None if x is None else round(x, 3)

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        return {"ok": False, "error": "no CUDA device"}
    if dev.type == "cuda":  # float32 means float32: no TF32 GEMMs
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    eos, n_new = 2, args.max_new_tokens
    target = tiny_llama(seed=0, vocab=256, hidden=128, layers=4, tied=True, max_positions=1024)
    for p in target.parameters():
        p.requires_grad_(False)
    c = target.config
    cfg = DLiteConfig(target_hidden_size=c.hidden_size, vocab_size=c.vocab_size, target_num_layers=c.num_hidden_layers,
                      num_context_positions=4, block_size=7, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=256, rnn_rank=72)
    torch.manual_seed(0)
    drafter = DLiteDrafter(cfg).eval().bind_hf_target(target)
    eng = ReferenceEngine(target, DLiteEngineDrafter(drafter), [eos], device=dev)  # moves target + drafter
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, c.vocab_size) for _ in range(rng.randrange(4, 60))] for _ in range(args.prompts)]

    def hf_greedy(p):
        ids = torch.tensor([p], device=dev)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)
        return out[0, len(p):].tolist()

    t0 = time.time()
    want = [hf_greedy(p) for p in prompts]
    res = [eng.generate(p, n_new) for p in prompts]
    impls = {op: ops.last_impl(op) for op in ("assemble_round_inputs", "round_attention", "lowrank_rnn_scan",
                                               "lm_head_argmax")}
    got = [r.output_ids for r in res]
    plain = [eng.generate(p, n_new, speculative=False).output_ids for p in prompts]
    oracle = ReferenceEngine(target, OracleDrafter({tuple(p + w): None for p, w in zip(prompts, want)}, num_drafts=7,
                                                   vocab_size=c.vocab_size), [eos], device=dev)
    ores = [oracle.generate(p, n_new) for p in prompts]
    sampled = eng.generate(prompts[0], n_new, temperature=0.8, top_p=0.95, seed=0)
    seconds = time.time() - t0
    first_diff = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    rec = {
        "device": str(eng.device), "target_device": str(next(target.parameters()).device),
        "drafter_device": str(next(drafter.parameters()).device),
        "hidden_device": None, "prompts": len(prompts), "max_new_tokens": n_new, "impl": impls, "ops": ops.build_status(),
        "dlite_identical": got == want, "no_spec_identical": plain == want,
        "oracle_identical": [r.output_ids for r in ores] == want,
        "dlite_tau": _rounded(tau_of_requests((len(r.output_ids), len(r.rounds)) for r in res)),
        "oracle_tau": _rounded(tau_of_requests((len(r.output_ids), len(r.rounds)) for r in ores)),
        "sampled_tokens": len(sampled.output_ids), "seconds": round(seconds, 2),
    }
    if first_diff is not None:
        g, w = got[first_diff], want[first_diff]
        j = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        rec["first_difference"] = {"prompt": first_diff, "position": j, "got": g[j:j + 4], "want": w[j:j + 4]}
    sess = eng.new_session()
    eng.generate(prompts[0], 4, session=sess)
    rec["hidden_device"] = str(sess.hidden.device) if sess.hidden is not None else None
    devices_ok = {rec["target_device"], rec["drafter_device"], rec["hidden_device"]} == {str(eng.device)} and \
        eng.device.type == dev.type
    rec["devices_ok"] = devices_ok
    rec["cuda_ops_required"] = args.require_cuda_ops
    ops_ok = set(impls.values()) == {"cuda"} if args.require_cuda_ops else True
    rec["ok"] = bool(rec["dlite_identical"] and rec["no_spec_identical"] and rec["oracle_identical"] and devices_ok
                     and ops_ok)
    eng.close()
    oracle.close()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("probe", "graphs", "engine"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True, help="the JSON record")
        if name in ("graphs", "engine"):
            p.add_argument("--require-cuda-ops", action="store_true",
                           help="fail unless every draft-step op ran as a CUDA kernel (the extension is built)")
        if name == "graphs":
            p.add_argument("--max-bs", type=int, default=32)
        if name == "engine":
            p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
            p.add_argument("--prompts", type=int, default=6)
            p.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    t0 = time.time()
    rec = {"probe": probe, "graphs": graphs, "engine": engine}[args.cmd](args)
    rec["wall_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, (dict, list))}, default=str))
    return 0 if rec.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
