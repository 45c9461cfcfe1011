"""End-to-end serving benchmark: DLITE (and sglang's NGRAM and EAGLE3) vs no speculation, same prompts, one run.

    python bench/e2e.py --engine sglang --workload agent-stdlib --concurrency 1,4,16 --out RESULT.json

For every mode (``dlite``, ``dlite:W``, ``hybrid[:W]``, ``dlite-only[:W]``, ``ngram[:W]``, ``eagle3[:W]``, ``nospec``) one
sglang Engine is started (start-up is not timed) and
the same requests (every recorded turn of the first ``--max-convs`` conversations of the
workload, rendered with the target's chat template) are run greedily at each concurrency:
``c`` requests in flight at a time (asyncio, ``Engine.async_generate``). Reported per
(mode, concurrency): output tokens/s (all output tokens / wall time), mean latency per request,
tau (``sglang_dlite/drafting/tau.py``: committed tokens per verify round, the prefill's token excluded;
one function on the same counts for both engines: ``level_row``), the share of rounds per drafting
source (hybrid modes: the worker's lookup trace), and whether the speculative outputs equal the
no-speculation outputs (they must, greedy). ``ngram`` is sglang's own prompt-lookup drafter (its
trie corpus, tree verify; W = 8 draft tokens by default): the training-free peer. Its corpus keeps
the requests it served (``flush_cache`` flushes the radix cache, not the corpus) and every level
replays the same requests, so every level of an ngram mode runs on a fresh engine (so does every
level of a mode with online learning: its adapted drafter has learned the requests it served). ``eagle3`` is
sglang's own EAGLE3 worker running the project's EAGLE-3-style baseline (trained on the same data
as DLite, exported by ``dlite_lab.baselines.sglang_export``), a chain of W-1 = 7 drafts (topk 1;
on a CPU the stand-ins run its draft attention on torch_native, chains only): the same-budget
trained peer with a draft KV cache. ``--engine reference`` runs the HF reference
engine instead (concurrency 1 only).

DLITE modes: ``dlite`` is DLITE's default drafting, which is hybrid (DLite + the per-request suffix
lookup, chosen per request every round); ``hybrid`` says so explicitly; ``hybrid-fixed`` verifies all W-1 drafts every round
(the setting ``verify_width: fixed``; on a CPU the default picks each round's width from the
chains' calibrated acceptance and the verify cost it has measured, ``drafting/budget.py``);
``dlite-only`` turns the
lookup off (the setting ``lookup: false``: DLite alone, the previous release's drafting);
``dlite-chain`` is the hybrid with chains only (the setting ``tree_max_batch_size: 0``; by default a
CPU drafts token trees for greedy batches of up to 16 requests, ``serving/rounds.py``);
``dlite-online`` is ``dlite`` with online learning on (the setting ``online: true``, issue 47); any DLITE
mode takes serving settings after ``+`` (``dlite+tree_max_batch_size=64+soft_batch_size=32``). The suffix
lookup indexes only the request's own tokens (prompt + its output so far): a replayed request
never sees its own recorded answer, and nothing carries over between requests or levels.

Noise: on a 2-core machine one run's tokens/s moves by 10-15 % (the scheduler's two torch threads
share the cores with the tokenizer and detokenizer processes). ``--repeats R`` runs every mode R
times (a fresh engine each time, the mode order rotated between repeats so drift hits every mode
alike) and reports the MEDIAN wall time per (mode, concurrency), with the min-max spread, and every
mode against the first one repeat by repeat (``paired``: the median of the same-repeat tokens/s ratios,
which cancels the machine's slow drift that each mode's own median keeps).

Precision: the default ``--dtype`` is what a deployment on this machine runs: bfloat16 on a GPU
and on a CPU with bf16 arithmetic (avx512_bf16 / AMX), float32 on a CPU without it (oneDNN emulates
bf16 there: no speculation ran 7.7-8.9 tok/s in bf16 vs 15.0 in fp32 on such a CPU). In bf16 greedy output is
then identical to no speculation only up to bf16 rounding: a verify pass computes a token's logits
in a W-token GEMM, a decode step in a 1-token GEMM, and bf16 logits near 20 are spaced 0.125
apart, so exact and near ties fall either way (no-speculation itself differs between concurrency
levels for the same reason; the table shows that floor). For every request whose output differs,
the first differing position is re-scored with the HF target in float32 and the logit gap
between the two tokens is reported: a divergence is a ``tie`` if that gap is below
``--tie-margin`` (default 0.25, two bf16 steps at |logit| ~ 20) or, in bfloat16, below the change
bf16 itself makes to the float32 target's top-2 logit gap on that request's sequence (measured by
re-running it in bf16: ``bf16_noise`` in the JSON; on a CPU with AMX it reaches 0.35-0.55 on the
demo's sequences); beyond it, if the float32
target prefers the speculative token the baseline is the one off the exact path (``baseline_off``,
e.g. no speculation's bf16 prefill in a batch of 16); otherwise it is counted as a real mismatch
and the run exits 1. ``--dtype float32`` makes the comparison exact (on a CPU with avx512_bf16
tokens/s are lower: there fp32 GEMMs of 2-8 rows cost 1.6-1.8x a 1-row GEMV).

On this project's CPU machines the CPU-only stand-ins are loaded (``--device cpu``, default when
no CUDA device is visible); on a CUDA machine pass ``--device cuda`` (no stand-ins).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from dlite_lab.benchmarking.sglang_runs import (ATTENTION, aggregate, build_requests, level_row, paired,
                                                   prefill_attention, reference_meta, remembers_requests,
                                                   run_sglang)
from dlite_lab.divergence import DEFAULT_TIE_MARGIN, Fp32LogitGap, classify_divergences, is_mismatch
from sglang_dlite.drafting.tau import TAU_DEFINITION


REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("sglang", "reference"), default="sglang")
    p.add_argument("--workload", default="agent-stdlib", help="built-in workload name or a .jsonl file")
    p.add_argument("--max-convs", type=int, default=2)
    p.add_argument("--max-requests", type=int, default=16)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model-path", default="default")
    p.add_argument("--draft", default=None, help="DLite checkpoint (default: the shipped drafter)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--modes", default="dlite,nospec",
                   help="dlite (DLITE default drafting = hybrid, verify all K drafts), dlite:W (verify the anchor + "
                        "the first W-1 drafts, = --speculative-num-draft-tokens W), hybrid[:W] (the same, lookup on "
                        "explicitly), hybrid-fixed[:W] (hybrid verifying all W-1 drafts every round: "
                        "the setting verify_width: fixed; the default picks the width per round on a CPU), "
                        "dlite-only[:W] (lookup off: DLite alone), ngram[:W] (sglang's NGRAM, default "
                        "W=8), eagle3[:W] (sglang's EAGLE3 worker on the project's EAGLE-3-style baseline "
                        "exported to its format, a chain of W-1 drafts, default W=8), nospec; a DLITE mode takes serving "
                        "settings after + (dlite+tree_max_batch_size=64)")
    p.add_argument("--eagle3-draft", default=None,
                   help="the EAGLE-3-style baseline checkpoint the eagle3 mode exports for sglang (default: the "
                        "shipped one)")
    p.add_argument("--dtype", default=None,
                   help="target dtype, the same for every mode: bfloat16, float32, or auto (the checkpoint's). "
                        "Default: bfloat16 on a GPU or a CPU with avx512_bf16/AMX (a 4-8 token verify then costs "
                        "little more than a 1-token decode step), float32 on a CPU without bf16 arithmetic")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every mode this many times (fresh engine each, rotated order); report the median")
    p.add_argument("--tie-margin", type=float, default=DEFAULT_TIE_MARGIN,
                   help="float32 logit gap below which a differing greedy token is a precision tie (see above)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="sglang --tp-size for every mode without its own @tpN suffix (e.g. --modes "
                        "nospec,dlite,dlite@tp2 compares DLITE at tp 2 with no speculation and DLITE at tp 1)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="sglang --dp-size (replicas) for every mode without its own @dpN suffix")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (> 0: outputs are random, so no divergence scoring: "
                        "speed and tau only; losslessness of sampling is tested, not benchmarked)")
    p.add_argument("--baseline-attention", choices=ATTENTION, default="same",
                   help="a CPU's decode and prefill attention: same (default: no speculation's decode forwards "
                        "read the KV cache through the attention code DLITE's verify runs, and every mode's prefill "
                        "through the project's, like for like) or sglang (as sglang ships it, slower at a batch of "
                        "several requests and on radix-cache hits)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def run_reference(mode, target, draft, reqs, max_new):
    import torch

    from dlite_lab.reference.drafters import DLiteEngineDrafter
    from dlite_lab.reference.engine import ReferenceEngine
    from sglang_dlite.model.dlite import DLiteDrafter
    from sglang_dlite.model.bundled_target import load_target

    model, tok = load_target(str(target))
    d = DLiteDrafter.from_pretrained(draft).bind_hf_target(model)
    drafter = DLiteEngineDrafter(d)
    if mode.split(":")[0] in ("dlite", "hybrid", "hybrid-fixed", "dlite-chain"):  # DLITE's default drafting: hybrid
        from dlite_lab.registry import served_hybrid

        drafter = served_hybrid(drafter, chain=mode.split(":")[0] == "dlite-chain")
    eng = ReferenceEngine(model, drafter, eos_token_ids=[tok.eos_token_id])
    outs, lat, metas = [], [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for r in reqs:
            t1 = time.perf_counter()
            g = eng.generate(r, max_new, speculative=mode.split(":")[0] in ("dlite", "hybrid", "hybrid-fixed", "dlite-only",
                                                                              "dlite-chain"))
            lat.append(time.perf_counter() - t1)
            outs.append(g.output_ids)
            metas.append(reference_meta(g))
    wall = time.perf_counter() - t0
    row = level_row(mode, 1, metas, wall, lat)
    print(json.dumps(row), flush=True)
    return [row], {1: outs}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from sglang_dlite.model.dlite import shipped_drafter_path
    from sglang_dlite.model.bundled_target import resolve_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = resolve_target(args.model_path)
    draft = args.draft or shipped_drafter_path()
    note = None
    if draft is None:
        import tempfile

        from dlite_lab.benchmarking.random_models import save_random_dlite

        draft = save_random_dlite(os.path.join(tempfile.mkdtemp(), "random-dlite"), target)
        note = "no shipped drafter: a RANDOM DLite drafter was used (tau ~1)"
        print("NOTE:", note)
    tok = AutoTokenizer.from_pretrained(target)
    reqs = build_requests(tok, args.workload, args.max_convs, args.max_requests, args.max_new_tokens)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    if args.engine == "reference" and any(m.startswith(("ngram", "eagle3")) for m in modes):
        raise SystemExit("--engine reference runs dlite and nospec; ngram and eagle3 are sglang's NGRAM and EAGLE3 "
                         "workers (--engine sglang)")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.dtype is None:
        from sglang_dlite import ops

        args.dtype = "bfloat16" if device != "cpu" or ops.cpu_has_native_bf16() else "float32"
    print(f"{len(reqs)} requests ({sum(map(len, reqs))} prompt tokens), levels {levels}, device {device}, "
          f"dtype {args.dtype}, {args.repeats} repeat(s), torch threads {torch.get_num_threads()} here", flush=True)
    runs, outs = {m: [] for m in modes}, {}
    for rep in range(args.repeats):
        order = modes[rep % len(modes):] + modes[: rep % len(modes)]
        for mode in order:
            if args.engine == "sglang" and remembers_requests(mode):
                # a fresh engine per level: NGRAM's corpus keeps every request it served (tau 4.83 at 4 after
                # 2.42 at 1), online learning's adapted drafter learned them: a later level would replay them
                r, o = [], {}
                for c in levels:
                    rc, oc = run_sglang(mode, target, draft, reqs, [c], args.max_new_tokens, device, args.dtype,
                                        args.tp_size, args.dp_size, args.eagle3_draft, args.temperature,
                                        attention=args.baseline_attention)
                    r, o = r + rc, {**o, **oc}
            elif args.engine == "sglang":
                r, o = run_sglang(mode, target, draft, reqs, levels, args.max_new_tokens, device, args.dtype,
                                  args.tp_size, args.dp_size, args.eagle3_draft, args.temperature,
                                  attention=args.baseline_attention)
            else:
                if args.temperature > 0:
                    raise SystemExit("--temperature > 0 is for --engine sglang")
                r, o = run_reference(mode, target, draft, reqs, args.max_new_tokens)
            runs[mode].append(r)
            outs.setdefault(mode, o)  # outputs of the first repeat
    rows = [row for m in modes for row in aggregate(runs[m])]
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + (argv if argv is not None else sys.argv[1:])),
        "engine": args.engine, "device": device, "workload": args.workload, "target": str(target),
        "drafter": str(draft), "note": note, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "dtype": args.dtype if args.engine == "sglang" else "float32", "repeats": args.repeats,
        "tie_margin": args.tie_margin, "tau_definition": TAU_DEFINITION, "baseline_attention": args.baseline_attention,
        "prefill_attention": prefill_attention(args.baseline_attention),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows, "runs": runs, "outputs": {m: {str(c): o for c, o in lv.items()} for m, lv in outs.items()},
    }
    if args.out:  # the measured rows first: the divergence scoring below can take minutes in bf16
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**result, "table": None, "divergences": "not scored yet"}, indent=2))

    score = Fp32LogitGap(target) if args.temperature == 0 else None  # sampled outputs differ by design
    noise = score.bf16_noise if score is not None and args.engine == "sglang" and args.dtype == "bfloat16" else None
    table, divergences = [], {}
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    spec_modes = [m for m in modes if m.partition("@")[0] != "nospec"]
    base = outs.get("nospec", {})
    for c in sorted({r["concurrency"] for r in rows}):
        if score is not None and c != levels[0] and levels[0] in base and c in base:  # the no-speculation floor
            divergences[f"nospec@{c} vs nospec@{levels[0]}"] = classify_divergences(
                reqs, base[c], base[levels[0]], score, args.tie_margin, noise=noise)
        for m in spec_modes:
            d, b = by.get((m, c)), by.get(("nospec", c))
            if not (d and b):
                continue
            div = [] if score is None else classify_divergences(reqs, outs[m][c], base[c], score, args.tie_margin,
                                                                 noise=noise)
            if score is not None:
                divergences[f"{m}@{c} vs nospec@{c}"] = div
            table.append({"mode": m, "concurrency": c, "spec_tok_s": d["tokens_per_s"], "nospec_tok_s": b["tokens_per_s"],
                          "speedup": round(d["tokens_per_s"] / b["tokens_per_s"], 3), "tau": d["tau"],
                          "spec_latency_s": d["mean_latency_s"], "nospec_latency_s": b["mean_latency_s"],
                          "identical": None if score is None else len(reqs) - len(div), "requests": len(reqs),
                          "ties": sum(x["tie"] for x in div), "baseline_off": sum(x["baseline_off"] for x in div),
                          "mismatches": sum(is_mismatch(x) for x in div),
                          "identical_outputs": None if score is None else not div,
                          **{f"{side}_{k}": r.get(k) for side, r in (("spec", d), ("nospec", b))
                             for k in ("ttft_p50_s", "itl_p50_ms", "itl_p99_ms")}})
    print("\n| mode | concurrency | spec tok/s | no-spec tok/s | speed-up | tau | TTFT p50 s spec / no-spec "
          "| ITL p50 / p99 ms spec | ITL p50 / p99 ms no-spec | identical | precision ties | baseline off | mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['mode']} | {t['concurrency']} | {t['spec_tok_s']} | {t['nospec_tok_s']} | {t['speedup']}x | {t['tau']} | "
              f"{t['spec_ttft_p50_s']} / {t['nospec_ttft_p50_s']} | {t['spec_itl_p50_ms']} / {t['spec_itl_p99_ms']} | "
              f"{t['nospec_itl_p50_ms']} / {t['nospec_itl_p99_ms']} | {'sampled' if t['identical'] is None else t['identical']}/{t['requests']} | {t['ties']} | "
              f"{t['baseline_off']} | {t['mismatches']} |")
    for k, div in divergences.items():
        if k.startswith("nospec@"):
            print(f"floor: {k}: {len(reqs) - len(div)}/{len(reqs)} identical, "
                  f"{sum(x['tie'] for x in div)} precision ties, {sum(not x['tie'] for x in div)} beyond the margin")
    pairs = paired(runs, modes[0]) if args.repeats > 1 else []
    if pairs:
        print(f"\n| mode | concurrency | vs {modes[0]}: median of same-repeat tok/s ratios (min-max) | "
              "draft / verify / learn ms per round (medians) |")
        print("|---|---|---|---|")
        for p in pairs:
            print(f"| {p['mode']} | {p['concurrency']} | {p['paired_ratio']}x ({p['paired_min']}-{p['paired_max']}) | "
                  f"{p.get('draft_ms_per_round_median')} / {p.get('verify_ms_per_round_median')} / "
                  f"{p.get('learn_ms_per_round_median', '-')} |")
    result.update(table=table, divergences=divergences, paired=pairs)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0 if all(t["mismatches"] == 0 for t in table) else 1


if __name__ == "__main__":
    sys.exit(main())
