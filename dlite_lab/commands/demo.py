"""`sglang-dlite demo` (`make demo`): the default target + the default DLite drafter in a real
sglang Engine on this CPU.

Replays one agent conversation (agent-stdlib: an agent reading Python stdlib source with tools;
every turn extends the previous one, so later turns hit sglang's prefix cache) and a few plain
prompts, with ``--speculative-algorithm DLITE`` and without speculation, on the same prompt
tokens, twice, with DLITE's default drafting (hybrid: DLite + the suffix lookup; on a CPU chains
up to 15 drafts and a per-round verify width): in float32 (exactness: greedy outputs must be
identical) and in bfloat16 (speed: what this CPU runs fast; the outputs may part only at bf16
precision ties, each one checked against the float32 target).
Prints the text, tau (``drafting/tau.py``: committed tokens per verify round, the prefill's token
excluded, from sglang's completion_tokens and spec_verify_ct), tokens/s of both runs and the
comparison of the outputs; exits 1 on a real mismatch.

The CPU-only stand-ins (``cpu_support/sglang_cpu``) are loaded for this process and the sglang
subprocesses; on a CUDA machine run ``sglang-dlite serve`` instead. If sglang cannot start here,
the demo says why and falls back to the reference engine (``--engine reference``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from sglang_dlite.serving import cpu_launch as F
from sglang_dlite.model.config import drafter_config_for_target
from dlite_lab.divergence import DEFAULT_TIE_MARGIN as TIE_MARGIN
from dlite_lab.divergence import Fp32LogitGap, classify_divergences, is_mismatch
from dlite_lab.reference.drafters import DLiteEngineDrafter
from sglang_dlite.model.dlite import shipped_drafter_path
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.tau import TAU_DEFINITION, tau_of_sglang
from sglang_dlite.model.bundled_target import load_target, prepare_default_target
from dlite_lab.workloads import load_workload
from dlite_lab.workloads.render import render_turns
from dlite_lab.commands.generate import chat_ids

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of Python's collections.Counter.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("sglang", "reference"), default="sglang")
    p.add_argument("--draft", default=None, help="DLite checkpoint folder (default: the shipped drafter)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--workload", default="agent-stdlib", help="workload of the agent conversation")
    p.add_argument("--no-agent", action="store_true", help="skip the agent conversation")
    p.add_argument("--prompts", type=int, default=1, help="how many plain prompts (0-3)")
    p.add_argument("--dtype", default="both", choices=("both", "float32", "bfloat16"),
                   help="both (default): an exactness comparison in float32 (DLITE's greedy output must equal "
                        "no speculation token for token), then a speed comparison in bfloat16 (what a CPU "
                        "with avx512_bf16/AMX runs fast; equal up to bf16 precision ties, reported). "
                        "float32 / bfloat16: one of them")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="--speculative-num-draft-tokens W: verify at most the anchor + W-1 drafts per round "
                        "(default: DLITE's, 16 on a CPU with hybrid drafting)")


def _drafter_path(args, target_dir) -> str:
    path = args.draft or shipped_drafter_path()
    if path:
        print(f"drafter: {path}")
        return path
    out = os.path.join(tempfile.mkdtemp(prefix="dlite-demo-"), "random-dlite")
    torch.manual_seed(0)
    DLiteDrafter(drafter_config_for_target(str(target_dir))).save_pretrained(out)
    print("NOTE: no trained DLite drafter is shipped in this build yet: using a RANDOMLY "
          f"initialized one ({out}). Outputs stay identical (lossless), but tau is ~1 and "
          "DLITE is slower than no speculation until a trained drafter is used (--draft PATH).")
    return out


def _requests(args, tok):
    """[(label, prompt_ids)] : the agent conversation's turns, then the plain prompts."""
    reqs = []
    if not args.no_agent:
        conv = load_workload(args.workload, max_convs=1)[0]
        turns = render_turns(tok, conv, max_new_tokens=args.max_new_tokens)
        for t in turns:
            if t.placeholder:
                break
            reqs.append((f"agent {conv['id']} turn {t.index}", list(t.prompt_ids)))
    return reqs + [(text, chat_ids(tok, text)) for text in PROMPTS[: max(0, args.prompts)]]


def _run_sglang(target, draft, reqs, max_new, eos, dtype="float32", num_draft_tokens=None):
    F.activate_cpu_standins()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # sglang's CPU-platform warnings, x3 processes
    sp = {"temperature": 0.0, "max_new_tokens": max_new}
    t0 = time.perf_counter()
    extra = {"speculative_num_draft_tokens": num_draft_tokens} if draft and num_draft_tokens else {}
    e = F.start_engine(target, dlite=draft, max_total_tokens=32768, chunked_prefill_size=8192, dtype=dtype, **extra)
    start_s = time.perf_counter() - t0
    print(f"  sglang Engine ({'DLITE' if draft else 'no speculation'}) started in {start_s:.0f} s", flush=True)
    outs, metas, wall = [], [], 0.0
    try:
        for _, ids in reqs:  # one by one: an agent's turns arrive one after another
            t1 = time.perf_counter()
            o = e.generate(input_ids=ids, sampling_params=sp)
            wall += time.perf_counter() - t1
            outs.append(list(o["output_ids"]))
            metas.append(o["meta_info"])
            print(f"  [{'DLITE' if draft else 'no-spec'}] {len(outs)}/{len(reqs)}: "
                  f"{len(outs[-1])} tokens in {time.perf_counter() - t1:.1f} s", flush=True)
    finally:
        e.shutdown()
    return outs, metas, wall, start_s


def _run_reference(target_dir, draft, reqs, max_new, eos, speculative):
    target, _ = load_target(str(target_dir))
    d = DLiteDrafter.from_pretrained(draft).bind_hf_target(target)
    eng = ReferenceEngine(target, DLiteEngineDrafter(d), eos_token_ids=eos)
    outs, metas, wall = [], [], 0.0
    sess = eng.new_session()
    with torch.no_grad():
        for _, ids in reqs:
            t1 = time.perf_counter()
            r = eng.generate(ids, max_new, session=sess, speculative=speculative)
            wall += time.perf_counter() - t1
            outs.append(r.output_ids)
            metas.append({"spec_verify_ct": len(r.rounds), "completion_tokens": len(r.output_ids),
                          "cached_tokens": r.reused_prefix})
    eng.close()
    return outs, metas, wall, 0.0


def _fmt_tau(metas) -> str:
    """τ over the requests (``drafting.tau.tau_of_sglang``), 'n/a' without a verify round."""
    t = tau_of_sglang(metas)
    return "n/a" if t is None else f"{t:.2f}"


def _summary(title, spec, base, reqs, target, dtype) -> bool:
    """Print one comparison; True when the outputs are identical, or (bf16) differ only at
    precision ties of the float32 target."""
    (s_out, s_meta, s_wall, s_start), (b_out, _, b_wall, b_start) = spec, base
    s_toks, b_toks = sum(len(o) for o in s_out), sum(len(o) for o in b_out)
    print(f"\n=== {title} ===")
    if s_start:
        print(f"engine start-up: DLITE {s_start:.0f} s, no speculation {b_start:.0f} s (not in the timings)")
    print(f"DLITE          : {s_toks} tokens in {s_wall:.1f} s = {s_toks / max(s_wall, 1e-9):.1f} tokens/s, "
          f"tau = {_fmt_tau(s_meta)} ({TAU_DEFINITION})")
    print(f"no speculation : {b_toks} tokens in {b_wall:.1f} s = {b_toks / max(b_wall, 1e-9):.1f} tokens/s")
    print(f"speed-up       : {(s_toks / max(s_wall, 1e-9)) / max(b_toks / max(b_wall, 1e-9), 1e-9):.2f}x")
    same = s_out == b_out
    print(f"outputs identical (DLITE vs no speculation, {dtype}): {'YES' if same else 'NO'}")
    if same:
        return True
    scorer = Fp32LogitGap(str(target))
    noise = scorer.bf16_noise if dtype == "bfloat16" else None
    recs = classify_divergences([ids for _, ids in reqs], s_out, b_out, scorer, TIE_MARGIN, noise=noise)
    scorer.close()
    for r in recs:
        measured = f", bf16 error on this sequence up to {r['bf16_noise']}" if "bf16_noise" in r else ""
        print(f"  differs: {reqs[r['request']][0]} at output token {r['position']}: "
              f"{r['token']} vs {r['baseline_token']}, float32 logit gap {r['fp32_logit_gap']}{measured} -> "
              f"{_verdict(r)}")
    if dtype != "float32" and not any(is_mismatch(r) for r in recs):
        print(f"  every divergence is a {dtype} precision tie (float32 logit gap below {TIE_MARGIN} or below the "
              "change bf16 makes to the target's top-2 logit gap on that sequence): a verify pass rounds a W-token "
              "GEMM differently from a 1-token decode step (no speculation differs from itself across batch "
              "sizes and request orders the same way); float32 compares exactly")
        return True
    return False


def _verdict(rec: dict) -> str:
    if rec["tie"]:
        return "a bf16 precision tie"
    if rec["baseline_off"]:
        return "no speculation left the float32 target's choice here (DLITE kept it): a bf16 error of the baseline"
    return "A REAL MISMATCH"


def run(args) -> int:
    from transformers import AutoTokenizer  # start-up cost: ~2 s; the CLI imports every command module

    target = prepare_default_target(verbose=True)
    tok = AutoTokenizer.from_pretrained(str(target))
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    draft = _drafter_path(args, target)
    reqs = _requests(args, tok)
    n = args.max_new_tokens
    print(f"target: {target}\nrequests: {len(reqs)} ({sum(len(r[1]) for r in reqs)} prompt tokens), "
          f"greedy, max_new_tokens={n}\n")
    # (title, dtype) of each comparison
    if args.dtype == "both":
        how = (f"--speculative-num-draft-tokens {args.num_draft_tokens}" if args.num_draft_tokens
               else "default drafting")
        phases = [(f"exactness: float32, {how}", "float32"), (f"speed: bfloat16, {how}", "bfloat16")]
    else:
        phases = [(args.dtype, args.dtype)]

    engine = args.engine
    results = []
    if engine == "sglang":
        try:
            for title, dtype in phases:
                print(f"[{title}]", flush=True)
                results.append((title, dtype, _run_sglang(target, draft, reqs, n, eos, dtype, args.num_draft_tokens),
                                _run_sglang(target, None, reqs, n, eos, dtype)))
        except Exception as exc:  # keep the demo alive on a machine where sglang cannot start
            print(f"NOTE: the sglang engine failed here ({type(exc).__name__}: {exc}); "
                  "falling back to the reference engine.")
            engine, results = "reference", []
    if engine == "reference":
        results = [("reference engine, float32", "float32", _run_reference(target, draft, reqs, n, eos, True),
                    _run_reference(target, draft, reqs, n, eos, False))]

    s_out, s_meta = results[0][2][0], results[0][2][1]
    for (label, ids), o, m in zip(reqs, s_out, s_meta):
        print(f"--- {label}  (prompt {len(ids)} tokens, prefix-cache hit {m.get('cached_tokens', 0)})")
        print(tok.decode(o, skip_special_tokens=True).strip()[:600])
        if m.get("spec_verify_ct"):
            print(f"    [tau {_fmt_tau([m])} over {m['spec_verify_ct']} verify rounds]")
    where = "sglang Engine, CPU" if engine == "sglang" else "reference engine"
    ok = [_summary(f"{title} ({where})", spec, base, reqs, target, dtype) for title, dtype, spec, base in results]
    return 0 if all(ok) else 1
