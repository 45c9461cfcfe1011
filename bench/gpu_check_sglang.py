"""GPU checks of the DLITE sglang path (CUDA only; never run on the CPU machines). JSON out.

    python bench/gpu_check_sglang.py --out artifacts/gpu_check_sglang.json [--budget-s 420]

Called by bench/gpu_check.sh (one script, <= 8 minutes on one GPU). Needs a CUDA sglang 0.5.23
install (the real ``sglang-kernel``; the CPU stand-ins are NOT loaded here) and sglang-dlite
installed (the ``dlite`` plugin entry point). Checks, each recorded as pass/fail with details:

1. drafter_cuda_graph : the drafter's per-batch-size CUDA graphs propose exactly what the eager
                        drafter proposes (bf16 and fp32, batch sizes 1, 3, 16).
2. engine_lossless    : ``sgl.Engine(speculative_algorithm="DLITE")`` on the default target, CUDA
                        graphs ON, greedy: outputs == the same engine without speculation, for 8
                        prompts of different lengths, submitted together.
3. verify_in_graph    : DLITE's TARGET_VERIFY forwards replay the target's CUDA graphs
                        (``get_spec_info`` hook: FULL hidden-state capture inside the graph).
4. speed              : output tokens/s at concurrency 1, 4, 16, DLITE vs no speculation, and tau
                        (sglang_dlite/drafting/tau.py: committed tokens per verify round, prefill excluded).
Exit code 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path



def _check_drafter_graphs(result):
    import torch

    from sglang_dlite.model.config import DLiteConfig
    from sglang_dlite.model.dlite import DLiteDrafter
    from sglang_dlite.serving.worker import DrafterCudaGraphs

    details = {}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        cfg = DLiteConfig()
        d = DLiteDrafter(cfg).to("cuda", dtype).eval()
        V, H = cfg.vocab_size, cfg.target_hidden_size
        d.bind_target(torch.randn(V, H, device="cuda", dtype=dtype), torch.randn(V, H, device="cuda", dtype=dtype))
        graphs = DrafterCudaGraphs(d, 16, "cuda", dtype)
        for bs in (1, 3, 16):
            ctx = torch.randn(bs, cfg.num_capture_layers, cfg.num_context_positions, H, device="cuda", dtype=dtype)
            valid = torch.rand(bs, cfg.num_context_positions, device="cuda") > 0.2
            anchor = torch.randint(0, V, (bs,), device="cuda")
            eager = d.propose(ctx, valid, anchor).tokens
            g = graphs.propose(ctx, valid, anchor)
            same = bool(torch.equal(eager, g))
            details[f"{dtype}-bs{bs}"] = same
            ok &= same
    result["drafter_cuda_graph"] = {"pass": ok, "details": details}


def _engine(target, draft, **kw):
    import sglang as sgl

    args = dict(model_path=str(target), random_seed=0, max_running_requests=16, log_level="error",
                mem_fraction_static=0.6)
    if draft:
        args.update(speculative_algorithm="DLITE", speculative_draft_model_path=str(draft))
    args.update(kw)
    return sgl.Engine(**args)


def _prompts(tok):
    texts = ["Write a Python function that checks whether a number is prime.",
             "What is the capital of France?", "Explain recursion to a child.",
             "List five prime numbers.", "Translate 'good morning' into French and Spanish.",
             "Write a haiku about the sea.", "What does the json module in Python do?",
             "Summarize the plot of Hamlet in two sentences."]
    out = []
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def _check_engine(result, target, draft, budget_end):
    import asyncio

    from transformers import AutoTokenizer

    from sglang_dlite.drafting.tau import tau_of_sglang

    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = _prompts(tok)
    sp = {"temperature": 0.0, "max_new_tokens": 128, "ignore_eos": True}
    speed = {}
    outs = {}
    for mode, d in (("dlite", draft), ("nospec", None)):
        e = _engine(target, d)
        try:
            o = e.generate(input_ids=prompts, sampling_params=sp)
            outs[mode] = [x["output_ids"] for x in o]
            if mode == "dlite":
                metas = [x["meta_info"] for x in o]
                result["verify_in_graph"] = _verify_graph_status(e)
                result["tau_batch"] = tau_of_sglang(metas)
            for c in (1, 4, 16):
                if time.time() > budget_end:
                    break
                reqs = (prompts * 4)[: max(c, 8)]

                async def run():
                    sem = asyncio.Semaphore(c)

                    async def one(p):
                        async with sem:
                            return await e.async_generate(input_ids=p, sampling_params=sp)

                    return await asyncio.gather(*(one(p) for p in reqs))

                t0 = time.perf_counter()
                res = e.loop.run_until_complete(run())
                wall = time.perf_counter() - t0
                toks = sum(r["meta_info"]["completion_tokens"] for r in res)
                speed.setdefault(str(c), {})[mode] = {"tokens_per_s": toks / wall,
                                                      "tau": tau_of_sglang([r["meta_info"] for r in res])}
        finally:
            e.shutdown()
    same = outs.get("dlite") == outs.get("nospec")
    result["engine_lossless"] = {"pass": same, "n_prompts": len(prompts)}
    for c, v in speed.items():
        if "dlite" in v and "nospec" in v:
            v["speedup"] = v["dlite"]["tokens_per_s"] / v["nospec"]["tokens_per_s"]
    result["speed"] = speed


def _verify_graph_status(engine):
    """Best effort: the server's reported CUDA-graph use for the last decode batches."""
    try:
        info = engine.get_server_info()
        st = info.get("internal_states", [{}])[0]
        keys = {k: st[k] for k in st if "graph" in k.lower() or "accept" in k.lower()}
        return {"pass": bool(keys) and not info.get("disable_cuda_graph", False), "server_state": keys}
    except Exception as exc:  # noqa: BLE001
        return {"pass": False, "error": repr(exc)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="artifacts/gpu_check_sglang.json")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--draft", default=None)
    args = p.parse_args(argv)
    t_start = time.time()
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible")
        result["gpu"] = torch.cuda.get_device_name(0)
        import sglang

        result["sglang"] = getattr(sglang, "__version__", "?")
        _check_drafter_graphs(result)
        from sglang_dlite.model.dlite import shipped_drafter_path
        from sglang_dlite.model.bundled_target import prepare_default_target

        target = prepare_default_target(verbose=False)
        draft = args.draft or shipped_drafter_path()
        if draft is None:
            from dlite_lab.benchmarking.random_models import save_random_dlite

            draft = save_random_dlite(os.path.join(tempfile.mkdtemp(), "d"), str(target))
            result["note"] = "random drafter (none shipped): tau ~1"
        _check_engine(result, target, draft, t_start + args.budget_s)
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["elapsed_s"] = round(time.time() - t_start, 1)
    checks = [k for k in ("drafter_cuda_graph", "engine_lossless", "verify_in_graph") if k in result]
    result["pass"] = "error" not in result and all(result[k].get("pass") for k in checks) and len(checks) == 3
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
