"""End-to-end serving benchmark: DLITE (and sglang's NGRAM and EAGLE3) vs no speculation, same prompts, one run.

    python bench/e2e.py --engine sglang --workload agent-stdlib --concurrency 1,4,16 --out RESULT.json

For every mode (``dlite``, ``dlite:W``, ``hybrid[:W]``, ``dlite-only[:W]``, ``ngram[:W]``, ``eagle3[:W]``, ``nospec``) one
sglang Engine is started (start-up is not timed) and
the same requests (every recorded turn of the first ``--max-convs`` conversations of the
workload, rendered with the target's chat template) are run greedily at each concurrency:
``c`` requests in flight at a time (asyncio, ``Engine.async_generate``). Reported per
(mode, concurrency): output tokens/s (all output tokens / wall time), mean latency per request,
tau (``sglang_dlite/speculation/tau.py``: committed tokens per verify round, the prefill's token excluded;
one function on the same counts for both engines: ``level_row``), the share of rounds per drafting
source (hybrid modes: the worker's lookup trace), and whether the speculative outputs equal the
no-speculation outputs (they must, greedy). ``ngram`` is sglang's own prompt-lookup drafter (its
trie corpus, tree verify; W = 8 draft tokens by default): the training-free peer. Its corpus keeps
the requests it served (``flush_cache`` flushes the radix cache, not the corpus) and every level
replays the same requests, so every level of an ngram mode runs on a fresh engine. ``eagle3`` is
sglang's own EAGLE3 worker running the project's EAGLE-3-style baseline (trained on the same data
as DLite, exported by ``sglang_dlite.baselines.sglang_export``), a chain of W-1 = 7 drafts (topk 1;
on a CPU the stand-ins run its draft attention on torch_native, chains only): the same-budget
trained peer with a draft KV cache. ``--engine reference`` runs the HF reference
engine instead (concurrency 1 only).

DLITE modes: ``dlite`` is DLITE's default drafting, which is hybrid (DLite + the per-request suffix
lookup, chosen per request every round); ``hybrid`` says so explicitly; ``hybrid-fixed`` verifies all W-1 drafts every round
(``SGLANG_DLITE_VERIFY_WIDTH=fixed``; on a CPU the default picks each round's width from the
chains' calibrated acceptance and the verify cost it has measured, ``speculation/verify_width.py``);
``dlite-only`` turns the
lookup off (``SGLANG_DLITE_LOOKUP=0``: DLite alone, the previous release's drafting);
``dlite-chain`` is the hybrid with chains only (the setting ``tree_max_batch_size: 0``; by default a
CPU drafts token trees for greedy batches of up to 16 requests, ``sglang_plugin/tree_round.py``);
``dlite-online`` is ``dlite`` with online learning on (the setting ``online: true``, issue 47); any DLITE
mode takes serving settings after ``+`` (``dlite+tree_max_batch_size=64+soft_batch_size=32``). The suffix
lookup indexes only the request's own tokens (prompt + its output so far): a replayed request
never sees its own recorded answer, and nothing carries over between requests or levels.

Noise: on a 2-core machine one run's tokens/s moves by 10-15 % (the scheduler's two torch threads
share the cores with the tokenizer and detokenizer processes). ``--repeats R`` runs every mode R
times (a fresh engine each time, the mode order rotated between repeats so drift hits every mode
alike) and reports the MEDIAN wall time per (mode, concurrency), with the min-max spread.

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
import asyncio
import json
import math
import os
import platform
import sys
from statistics import median
import time
from pathlib import Path

from sglang_dlite.cpu_launch import omp_threads_bind
from sglang_dlite.divergence import DEFAULT_TIE_MARGIN, Fp32LogitGap, classify_divergences, is_mismatch
from sglang_dlite.speculation.tau import TAU_DEFINITION, tau, tau_of_sglang

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
                        "SGLANG_DLITE_VERIFY_WIDTH=fixed; the default picks the width per round on a CPU), "
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
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def parse_parallel(mode, tp_size=1, dp_size=1):
    """'dlite@tp2' -> ('dlite', 2, dp_size); 'nospec@dp2' -> ('nospec', tp_size, 2)."""
    import re

    base, _, par = mode.partition("@")
    for kind, n in re.findall(r"(tp|dp)(\d+)", par):
        tp_size, dp_size = (int(n), dp_size) if kind == "tp" else (tp_size, int(n))
    if par and not re.fullmatch(r"((tp|dp)\d+)+", par):
        raise SystemExit(f"mode {mode!r}: the suffix after @ is tpN and/or dpN (e.g. dlite@tp2, nospec@dp2)")
    return base, tp_size, dp_size


def parse_settings(mode):
    """'dlite+tree_max_batch_size=64+corpus_tokens=0' -> ('dlite', {'tree_max_batch_size': 64, 'corpus_tokens': 0}):
    DLITE serving settings (SGLANG_DLITE_CONFIG keys) for one mode, a JSON value each (a bare word: a
    string, its commas written as ; since --modes is comma-separated: 'dlite+online=lr=1e-3;background=0')."""
    base, *pairs = mode.split("+")
    settings = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not (key and eq):
            raise SystemExit(f"mode {mode!r}: a setting after + is key=value (e.g. dlite+tree_max_batch_size=64)")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value.replace(";", ",")
    return base, settings


def build_requests(tok, workload, max_convs, max_requests, max_new):
    from sglang_dlite.workloads import load_workload
    from sglang_dlite.workloads.render import render_turns

    reqs = []
    for conv in load_workload(workload, max_convs=max_convs):
        for t in render_turns(tok, conv, max_new_tokens=max_new):
            reqs.append(list(t.prompt_ids))
            if t.placeholder:  # a generated reply: later turns would need it (bfcl-multiturn: the first turn only)
                break
    return reqs[:max_requests]


async def _run_level(engine, reqs, conc, sp):
    """Every request streamed, ``conc`` in flight: (final outputs, latency per request, wall time,
    time to first token per request, inter-token latencies). A chunk that brings n tokens after a
    gap g counts n inter-token latencies of g / n (a speculative round commits several tokens at
    once; this is the per-token latency a reader of the stream sees on average)."""
    sem = asyncio.Semaphore(conc)
    outs = [None] * len(reqs)
    lat, ttft = [0.0] * len(reqs), [0.0] * len(reqs)
    itl = []

    async def one(i):
        async with sem:
            t0 = time.perf_counter()
            last_t, last_n, final = t0, 0, None
            async for chunk in await engine.async_generate(input_ids=reqs[i], sampling_params=sp, stream=True):
                now, n = time.perf_counter(), int(chunk["meta_info"]["completion_tokens"])
                if n > last_n:
                    if last_n == 0:
                        ttft[i] = now - t0
                    else:
                        itl.extend([(now - last_t) / (n - last_n)] * (n - last_n))
                    last_t, last_n = now, n
                final = chunk
            lat[i] = time.perf_counter() - t0
            outs[i] = final

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return outs, lat, time.perf_counter() - t0, ttft, itl


def flush_until_done(engine, tries: int = 50) -> None:
    """Flush the radix cache, retrying while the scheduler still holds a request (it refuses to flush
    then: right after a level's last streamed chunk it may not have retired that request yet; an
    unchecked flush left some levels warm and others cold)."""
    for _ in range(tries):
        out = engine.flush_cache()
        if getattr(out, "success", out) is not False:
            return
        time.sleep(0.1)
    raise SystemExit("the engine refused to flush its cache for 5 s: a request is still running")


def percentile(xs, q):
    """The q-th percentile (nearest rank) of xs; None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def eagle3_kwargs(w, src, target, dtype):
    """sglang EAGLE3 arguments: the EAGLE-3-style baseline (``src``, None = shipped) exported to the
    checkpoint sglang reads (``baselines/sglang_export.py``), a chain of W-1 drafts (topk 1)."""
    import tempfile

    import torch

    from sglang_dlite.baselines.sglang_export import export_sglang_eagle3

    n = int(w) if w else 8
    path = export_sglang_eagle3(src, os.path.join(tempfile.mkdtemp(prefix="dlite_eagle3_"), "eagle3"), target,
                                torch.float32 if dtype == "float32" else torch.bfloat16)
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": path, "speculative_eagle_topk": 1,
            "speculative_num_steps": n - 1, "speculative_num_draft_tokens": n}


# DLITE modes that are the default plus serving settings (SGLANG_DLITE_CONFIG keys)
MODE_SETTINGS = {"dlite-chain": {"tree_max_batch_size": 0},  # chains only
                 "dlite-online": {"online": True}}  # online learning, its serving defaults


def run_sglang(mode, target, draft, reqs, levels, max_new, device, dtype, tp_size=1, dp_size=1, eagle3_draft=None,
               temperature=0.0, requests_at=None, on_level=None):
    """One engine for ``mode``, every level of ``levels`` on it (flushed between levels): (rows, outputs
    per level). ``requests_at(c)``: how many of ``reqs`` level c runs (default all); ``on_level(row,
    outputs)`` is called as each level finishes (``bench/load_matrix.py`` checkpoints there)."""
    from sglang_dlite.cpu_launch import start_engine

    kw = dict(dtype=dtype, max_total_tokens=65536, chunked_prefill_size=8192, max_running_requests=max(levels))
    base_mode, tp_size, dp_size = parse_parallel(mode, tp_size, dp_size)
    kw.update(tp_size=tp_size, dp_size=dp_size)
    base_mode, settings = parse_settings(base_mode)
    spec, _, w = base_mode.partition(":")
    if spec not in ("dlite", "hybrid", "hybrid-fixed", "dlite-only", "dlite-chain", "dlite-online", "ngram",
                    "eagle3", "nospec"):
        raise SystemExit(f"unknown mode {mode!r}: dlite[:W], hybrid[:W], hybrid-fixed[:W], dlite-only[:W], "
                         "dlite-chain[:W], dlite-online[:W], ngram[:W], eagle3[:W] or nospec")
    lookup = {"hybrid": "1", "hybrid-fixed": "1", "dlite-only": "0"}.get(spec, os.environ.get("SGLANG_DLITE_LOOKUP", "1"))
    width = "fixed" if spec == "hybrid-fixed" else os.environ.get("SGLANG_DLITE_VERIFY_WIDTH", "auto")
    is_dlite = spec in ("dlite", "hybrid", "hybrid-fixed", "dlite-only", "dlite-chain", "dlite-online")
    import tempfile

    tmp = tempfile.mkdtemp(prefix="dlite_lookup_")
    trace, round_log = os.path.join(tmp, "trace.jsonl"), os.path.join(tmp, "rounds.jsonl")
    saved_env = {k: os.environ.get(k) for k in ("SGLANG_DLITE_LOOKUP", "SGLANG_DLITE_LOOKUP_TRACE",
                                                "SGLANG_DLITE_VERIFY_WIDTH", "SGLANG_CPU_OMP_THREADS_BIND",
                                                "SGLANG_DLITE_ROUND_LOG", "SGLANG_DLITE_CONFIG")}
    ranks = tp_size * dp_size
    if device == "cpu" and ranks > 1 and not saved_env["SGLANG_CPU_OMP_THREADS_BIND"]:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(ranks)  # sglang: each rank's cores
    os.environ["SGLANG_DLITE_LOOKUP"] = lookup  # read by the scheduler subprocess at start-up
    os.environ["SGLANG_DLITE_LOOKUP_TRACE"] = trace
    os.environ["SGLANG_DLITE_ROUND_LOG"] = round_log  # the worker's draft / verify ms per decode round
    os.environ["SGLANG_DLITE_VERIFY_WIDTH"] = width  # per-round verify width: auto (CPU: adaptive) or fixed
    if spec in MODE_SETTINGS or settings:  # the mode's serving settings over the caller's; other modes keep theirs
        from sglang_dlite.sglang_plugin.options import read_config

        if settings and not is_dlite:
            raise SystemExit(f"mode {mode!r}: +key=value serving settings are DLITE's (dlite... modes only)")
        os.environ["SGLANG_DLITE_CONFIG"] = json.dumps({**read_config(os.environ.get("SGLANG_DLITE_CONFIG")),
                                                        **MODE_SETTINGS.get(spec, {}), **settings})
    verify_kw = {"speculative_num_draft_tokens": int(w)} if spec != "nospec" and w else {}
    if spec == "ngram":
        verify_kw = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8, **verify_kw}
    if spec == "eagle3":
        verify_kw = eagle3_kwargs(w, eagle3_draft, target, dtype)
    t0 = time.perf_counter()
    if device == "cpu":
        e = start_engine(target, dlite=draft if is_dlite else None, **kw, **verify_kw)
    else:
        import sglang as sgl

        args = dict(model_path=str(target), dtype=dtype, sleep_on_idle=True, max_running_requests=max(levels), random_seed=0,
                    tp_size=tp_size, dp_size=dp_size, **verify_kw)
        if is_dlite:
            args.update(speculative_algorithm="DLITE", speculative_draft_model_path=str(draft))
        e = sgl.Engine(**args)
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    start_s = time.perf_counter() - t0
    sp = {"temperature": temperature, "max_new_tokens": max_new}
    rows, outputs = [], {}
    try:
        e.generate(input_ids=reqs[0][:32], sampling_params={"temperature": 0.0, "max_new_tokens": 4})  # warm-up
        for c in levels:
            flush_until_done(e)  # every level starts cold: same prefix-cache behaviour for every mode
            mark = os.path.getsize(trace) if os.path.exists(trace) else 0
            rmark = os.path.getsize(round_log) if os.path.exists(round_log) else 0
            level_reqs = reqs[:requests_at(c)] if requests_at else reqs
            outs, lat, wall, ttft, itl = e.loop.run_until_complete(_run_level(e, level_reqs, c, sp))
            shares, width = _trace_stats(trace, mark)
            round_ms = _round_stats(round_log, rmark)
            rows.append(level_row(mode, c, [o["meta_info"] for o in outs], wall, lat, ttft, itl))
            rows[-1]["start_up_s"] = round(start_s, 1)
            if shares:
                rows[-1]["source_share"] = shares
            if width:
                rows[-1]["mean_verify_width"] = width
            if round_ms:
                rows[-1].update(round_ms)
            outputs[c] = [list(o["output_ids"]) for o in outs]
            print(json.dumps(rows[-1]), flush=True)
            if on_level is not None:
                on_level(rows[-1], outputs[c])
    finally:
        e.shutdown()
    return rows, outputs


def _jsonl_after(path, offset):
    """The JSON records of a JSON-lines file written by the engine, from byte ``offset`` on (a torn
    or garbled line is skipped; no file: none)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def _trace_stats(trace, offset):
    """(share of decode rounds per drafting source, mean verify width per round) in the worker's
    lookup trace after ``offset``."""
    cnt, widths = {}, []
    for rec in _jsonl_after(trace, offset):
        for s in rec.get("sources") or []:
            cnt[s] = cnt.get(s, 0) + 1
        if rec.get("width"):
            widths.append(int(rec["width"]))
    tot = sum(cnt.values())
    return ({k: round(v / tot, 3) for k, v in sorted(cnt.items())} if tot else {},
            round(sum(widths) / len(widths), 2) if widths else None)


POSITION_BUCKET = 32  # output tokens per bucket of tau by output position


def _round_stats(path, offset):
    """Mean draft / verify ms per decode round, the rounds, and acceptance by output position, from the
    worker's round log (``SGLANG_DLITE_ROUND_LOG``) after ``offset``; {} when there is none (no
    speculation). ``rounds_by_position``: {bucket start: [request-rounds, tokens committed]} for the
    request-rounds whose output length before the round falls in [start, start + POSITION_BUCKET):
    tau at that depth of the answer = committed / request-rounds (``tau_by_position``)."""
    recs = list(_jsonl_after(path, offset))
    if not recs:
        return {}
    n = len(recs)
    by_pos = {}
    for r in recs:
        for p, a in zip(r.get("pos") or (), r.get("acc") or ()):
            cell = by_pos.setdefault(int(p) // POSITION_BUCKET * POSITION_BUCKET, [0, 0])
            cell[0] += 1
            cell[1] += int(a) + 1
    return {"decode_rounds": n, "draft_ms_per_round": round(sum(float(r["draft_ms"]) for r in recs) / n, 2),
            "verify_ms_per_round": round(sum(float(r["verify_ms"]) for r in recs) / n, 2),
            "tree_round_share": round(sum(1 for r in recs if r.get("tree")) / n, 3),
            **({"rounds_by_position": {str(k): v for k, v in sorted(by_pos.items())}} if by_pos else {})}


def tau_by_position(rows) -> dict:
    """{bucket start: tau} pooled over ``rows`` (their ``rounds_by_position``)."""
    pooled = {}
    for row in rows:
        for k, (n, committed) in (row.get("rounds_by_position") or {}).items():
            cell = pooled.setdefault(int(k), [0, 0])
            cell[0] += n
            cell[1] += committed
    return {k: round(tau(c, n), 3) for k, (n, c) in sorted(pooled.items()) if n}


def level_row(mode, concurrency, metas, wall, lat, ttft=(), itl=()) -> dict:
    """One (mode, concurrency) row from its requests' counts, for both engines: ``metas`` are
    sglang's ``meta_info`` (``completion_tokens``, the prefill's token included; ``spec_verify_ct``)
    or the reference engine's same counts (``reference_meta``); tau is ``speculation.tau.tau_of_sglang``."""
    toks = sum(int(m["completion_tokens"]) for m in metas)
    t = tau_of_sglang(metas)
    return {"mode": mode, "concurrency": concurrency, "requests": len(metas), "output_tokens": toks,
            "verify_rounds": sum(int(m.get("spec_verify_ct") or 0) for m in metas),
            "wall_s": round(wall, 3), "tokens_per_s": round(toks / wall, 2),
            "mean_latency_s": round(sum(lat) / len(lat), 3),
            "tau": None if t is None else round(t, 3),
            **{k: (None if v is None else round(v * scale, 3)) for k, v, scale in (
                ("ttft_p50_s", percentile(ttft, 50), 1), ("ttft_p99_s", percentile(ttft, 99), 1),
                ("itl_p50_ms", percentile(itl, 50), 1e3), ("itl_p99_ms", percentile(itl, 99), 1e3))}}


def reference_meta(g) -> dict:
    """A reference-engine ``GenerationResult``'s counts as sglang reports them: output tokens (the
    prefill's included) and verify rounds (none for the prefill)."""
    return {"completion_tokens": len(g.output_ids), "spec_verify_ct": len(g.rounds)}


def run_reference(mode, target, draft, reqs, max_new):
    import torch

    from sglang_dlite.drafters import DLiteEngineDrafter
    from sglang_dlite.engine import ReferenceEngine
    from sglang_dlite.model import DLiteDrafter
    from sglang_dlite.target import load_target

    model, tok = load_target(str(target))
    d = DLiteDrafter.from_pretrained(draft).bind_hf_target(model)
    drafter = DLiteEngineDrafter(d)
    if mode.split(":")[0] in ("dlite", "hybrid", "hybrid-fixed", "dlite-chain"):  # DLITE's default drafting: hybrid
        from sglang_dlite.registry import served_hybrid

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


def aggregate(runs):
    """runs: [[row per level] per repeat] of one mode -> one row per level: median tokens/s,
    latency and tau over the repeats, with the tokens/s spread."""
    rows = []
    for level_rows in zip(*runs):
        tps = [r["tokens_per_s"] for r in level_rows]
        row = dict(level_rows[0])
        row.update(
            tokens_per_s=round(median(tps), 2),
            wall_s=round(median([r["wall_s"] for r in level_rows]), 3),
            mean_latency_s=round(median([r["mean_latency_s"] for r in level_rows]), 3),
            tau=None if level_rows[0]["tau"] is None else round(median([r["tau"] for r in level_rows]), 3),
            **{k: round(median([r[k] for r in level_rows]), 3) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms",
                                                                          "itl_p99_ms") if level_rows[0].get(k) is not None},
            repeats=len(level_rows), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
        )
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from sglang_dlite.drafters import shipped_drafter_path
    from sglang_dlite.target import resolve_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = resolve_target(args.model_path)
    draft = args.draft or shipped_drafter_path()
    note = None
    if draft is None:
        import tempfile

        from sglang_dlite.benchmarking.random_models import save_random_dlite

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
            if args.engine == "sglang" and mode.startswith("ngram"):
                # a fresh NGRAM engine per level: its corpus keeps every request it served, so a level
                # after the first would replay requests it has memorized (tau 4.83 at 4 after 2.42 at 1)
                r, o = [], {}
                for c in levels:
                    rc, oc = run_sglang(mode, target, draft, reqs, [c], args.max_new_tokens, device, args.dtype,
                                        args.tp_size, args.dp_size, args.eagle3_draft, args.temperature)
                    r, o = r + rc, {**o, **oc}
            elif args.engine == "sglang":
                r, o = run_sglang(mode, target, draft, reqs, levels, args.max_new_tokens, device, args.dtype,
                                  args.tp_size, args.dp_size, args.eagle3_draft, args.temperature)
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
        "tie_margin": args.tie_margin, "tau_definition": TAU_DEFINITION,
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
    result.update(table=table, divergences=divergences)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0 if all(t["mismatches"] == 0 for t in table) else 1


if __name__ == "__main__":
    sys.exit(main())
