"""`sglang-dlite generate`: speculative generation with the reference engine (HF transformers).

Prints the text, tau, and tokens/s with the drafter vs the target alone on the same prompts.
"""

from __future__ import annotations

import time

import torch

from dlite_lab.reference.engine import ReferenceEngine
from dlite_lab.registry import make_engine_drafter
from sglang_dlite.model.bundled_target import load_target


def add_arguments(p):
    p.add_argument("prompts", nargs="*", default=["Write a Python function that checks if a number is prime."],
                   help="user messages (each rendered with the target's chat template)")
    p.add_argument("--target", default="default", help="HF checkpoint folder, or 'default' (bundled SmolLM2)")
    p.add_argument("--drafter", default="dlite", help="dlite (shipped default) or dlite:PATH")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (pinned, reported)")
    p.add_argument("--no-baseline", action="store_true", help="skip the autoregressive comparison")


def chat_ids(tok, text: str) -> list:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def run(args) -> int:
    torch.set_num_threads(args.threads)
    target, tok = load_target(args.target)
    eng = ReferenceEngine(target, make_engine_drafter(args.drafter, target), [tok.eos_token_id])
    for text in args.prompts:
        ids = chat_ids(tok, text)
        t0 = time.perf_counter()
        res = eng.generate(ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        spec_s = time.perf_counter() - t0
        print(f"\n>>> {text}\n{tok.decode(res.output_ids, skip_special_tokens=True)}")
        line = f"[dlite] tokens={len(res.output_ids)} tau={res.tau:.2f} {len(res.output_ids) / spec_s:.1f} tok/s"
        if not args.no_baseline:
            t0 = time.perf_counter()
            ar = eng.generate(ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, speculative=False)
            ar_s = time.perf_counter() - t0
            line += f" | target alone {len(ar.output_ids) / ar_s:.1f} tok/s"
            if args.temperature <= 0:
                line += f" | identical={ar.output_ids == res.output_ids}"
        print(line + f" | threads={torch.get_num_threads()}")
    eng.close()
    return 0
