"""Transient host memory of one DLITE verify/accept step (serving/verify_logits.py) per round.

    python bench/verify_memory.py --batch 64 --width 8 --vocab 49152,151936 --out RESULT.json

What it measures: the peak bytes allocated *on top of* the verify logits [B*W, V] (the target's
output, which exists anyway) while one round runs ``process`` (penalties with the drafts counted,
logit_bias) + ``accept`` (argmax, or the sampler sglang's ``--sampling-backend pytorch`` runs on
the W rows of each request, as the CPU stack does) + ``commit``. Allocation is read from glibc's
``mallinfo2`` (bytes in use, heap + mmap) after every torch op through a TorchDispatchMode, so a
temporary that lives across ops is counted; one that lives only inside a single op is not.

Cases: greedy; greedy with frequency+presence+repetition penalties on every request; sampled
(temperature only: no sort); sampled with top-k 50 + top-p 0.9 (sglang's torch sampler sorts each
row: the same cost per row as its non-speculative decode). The sampler works in place on the
logits unless the batch returns logprobs (then it gets a copy: one more B*W*V*4 bytes).
Threads are pinned (--threads, default 1) and reported. Writes JSON (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode



class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use() -> int:
    m = _libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)


class PeakBytes(TorchDispatchMode):
    """Peak of malloc'd bytes in use, sampled after every torch op."""

    def __init__(self):
        super().__init__()
        self.base = in_use()
        self.peak = self.base

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use())
        return out


def _req(pen: bool):
    sp = types.SimpleNamespace(frequency_penalty=0.5 if pen else 0.0, presence_penalty=0.3 if pen else 0.0,
                               repetition_penalty=1.2 if pen else 1.0, min_new_tokens=0, stop_token_ids=set())
    return types.SimpleNamespace(sampling_params=sp, eos_token_ids={2}, tokenizer=None)


def _torch_sampler(temps, top_ks, top_ps, simple: bool, inplace: bool):
    """The standard path of sglang's Sampler.forward with --sampling-backend pytorch."""
    from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch

    def sample_rows(rows):
        logits = rows if inplace else rows.clone()
        logits.div_(temps)
        logits[:] = torch.softmax(logits, dim=-1)
        if simple:
            return sampling_from_probs_torch(logits)
        return top_k_top_p_min_p_sampling_from_probs_torch(logits, top_ks, top_ps, torch.zeros_like(top_ps), False,
                                                           None, None)
    return sample_rows


def one_round(case: str, B: int, W: int, V: int, inplace: bool = True) -> dict:
    from sglang_dlite.serving import verify_logits as VL

    torch.manual_seed(0)
    pen = case.endswith("penalties")
    reqs = [_req(pen) for _ in range(B)]
    VL.on_extend(reqs, torch.randint(0, V, (B,)), [100] * B, V)
    logits = torch.randn(B * W, V)
    block = torch.randint(0, V, (B, W))
    prefix = torch.full((B,), 100)
    batch = types.SimpleNamespace(reqs=reqs, sampling_info=types.SimpleNamespace(
        logit_bias=None, has_custom_logit_processor=False))
    sampler = None
    if case.startswith("sampled"):
        temps = torch.full((B * W, 1), 0.8)
        topk = case.startswith("sampled_topk")
        sampler = _torch_sampler(temps, torch.full((B * W,), 50 if topk else V, dtype=torch.int32),
                                 torch.full((B * W,), 0.9 if topk else 1.0), simple=not topk, inplace=inplace)
    t0 = time.perf_counter()
    with PeakBytes() as pk:
        VL.process(logits, W, batch, block, prefix)
        a, bonus = VL.accept(block[:, 1:], logits.view(B, W, V), sampler)
        out = block.clone()
        VL.commit(reqs, out, a)
    dt = time.perf_counter() - t0
    extra = pk.peak - pk.base
    return {"case": case, "batch": B, "width": W, "vocab": V, "inplace": inplace,
            "transient_bytes": extra, "transient_over_logits": extra / (B * W * V * 4), "seconds": dt}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=8, help="W = K + 1 verify positions per request")
    p.add_argument("--vocab", default="49152,151936")
    p.add_argument("--cases", default="greedy,greedy_penalties,sampled,sampled_topk_topp,sampled_penalties")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from sglang_dlite.serving.cpu_launch import activate_cpu_standins

    activate_cpu_standins()  # sglang's sampler module imports on this CPU machine
    one_round("greedy", 2, args.width, 1024)  # warm-up: lazy initialisation is not a round's cost
    rows = []
    todo = [(c, int(v), True) for v in args.vocab.split(",") for c in args.cases.split(",")]
    todo += [("sampled", int(v), False) for v in args.vocab.split(",")]  # return_logprob: a copy
    for i, (case, V, inplace) in enumerate(todo, 1):
        r = one_round(case, args.batch, args.width, V, inplace)
        rows.append(r)
        print(f"[{i}/{len(todo)}] {case} V={V} done", file=sys.stderr, flush=True)
    logits_mb = {int(v): args.batch * args.width * int(v) * 4 / 2**20 for v in args.vocab.split(",")}
    print(f"\nB={args.batch}, W={args.width}, torch threads {torch.get_num_threads()}; "
          f"verify logits themselves: " + ", ".join(f"V={v}: {mb:.0f} MiB" for v, mb in logits_mb.items()))
    print(f"{'case':<26}{'V':>8}{'transient MiB':>15}{'x logits':>10}{'s':>8}")
    for r in rows:
        name = r["case"] + ("" if r["inplace"] else " (logprobs)")
        print(f"{name:<26}{r['vocab']:>8}{r['transient_bytes'] / 2**20:>15.1f}"
              f"{r['transient_over_logits']:>10.2f}{r['seconds']:>8.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows,
                                              "command": " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
