"""Running sglang engines for the serving benchmarks (``bench/e2e.py``, ``bench/load_matrix.py``): the
requests of a workload, one engine per mode over concurrency levels (every request streamed; TTFT,
inter-token latency, τ, the worker's round log), the rows both engines report, medians over repeats.

Modes (``run_sglang``): ``dlite[:W]``, ``hybrid[:W]``, ``hybrid-fixed[:W]``, ``dlite-only[:W]``,
``dlite-chain``, ``dlite-online``, ``ngram[:W]``, ``eagle3[:W]``, ``nospec``; a DLITE mode takes serving
settings after ``+`` (``parse_settings``) and any mode tensor / data parallelism after ``@``
(``parse_parallel``). What each mode means: ``bench/e2e.py``'s docstring.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import tempfile
import time
from statistics import median

import torch

from sglang_dlite.serving import cpu_launch
from sglang_dlite.serving.cpu_launch import omp_threads_bind
from sglang_dlite.drafting.tau import tau, tau_of_sglang
from sglang_dlite.settings import ENV_CONFIG, read_config
from dlite_lab.workloads import load_workload
from dlite_lab.workloads.render import render_turns


def parse_parallel(mode, tp_size=1, dp_size=1):
    """'dlite@tp2' -> ('dlite', 2, dp_size); 'nospec@dp2' -> ('nospec', tp_size, 2)."""
    base, _, par = mode.partition("@")
    for kind, n in re.findall(r"(tp|dp)(\d+)", par):
        tp_size, dp_size = (int(n), dp_size) if kind == "tp" else (tp_size, int(n))
    if par and not re.fullmatch(r"((tp|dp)\d+)+", par):
        raise SystemExit(f"mode {mode!r}: the suffix after @ is tpN and/or dpN (e.g. dlite@tp2, nospec@dp2)")
    return base, tp_size, dp_size


def parse_settings(mode):
    """'dlite+tree_max_batch_size=64+corpus_tokens=0' -> ('dlite', {'tree_max_batch_size': 64, 'corpus_tokens': 0}):
    DLITE serving settings (SGLANG_DLITE_CONFIG keys) for one mode, a JSON value each (a bare word: a
    string, its commas written as ; since --modes is comma-separated: 'dlite+online=lr=1e-3;update_every=16')."""
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

    reqs = []
    for conv in load_workload(workload, max_convs=max_convs):
        for t in render_turns(tok, conv, max_new_tokens=max_new):
            reqs.append(list(t.prompt_ids))
            if t.placeholder:  # a generated reply: later turns would need it (bfcl-multiturn: the first turn only)
                break
    return reqs[:max_requests]


async def run_level(engine, reqs, conc, sp):
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
    from dlite_lab.baselines.sglang_export import export_sglang_eagle3  # the EAGLE3 mode only: its export code

    n = int(w) if w else 8
    path = export_sglang_eagle3(src, os.path.join(tempfile.mkdtemp(prefix="dlite_eagle3_"), "eagle3"), target,
                                torch.float32 if dtype == "float32" else torch.bfloat16)
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": path, "speculative_eagle_topk": 1,
            "speculative_num_steps": n - 1, "speculative_num_draft_tokens": n}


# DLITE modes that are the default plus serving settings (SGLANG_DLITE_CONFIG keys)


MODE_SETTINGS = {"dlite-chain": {"tree_max_batch_size": 0},  # chains only
                 "dlite-online": {"online": True},  # online learning, its serving defaults
                 "hybrid": {"lookup": True}, "hybrid-fixed": {"lookup": True, "verify_width": "fixed"},
                 "dlite-only": {"lookup": False}}  # DLite alone


def remembers_requests(mode) -> bool:
    """Whether ``mode``'s engine keeps something of the requests it served that a replay of them would
    read: sglang's NGRAM (its corpus) and DLITE with online learning (the server-scope adapted drafter).
    ``bench/e2e.py`` runs every level of such a mode on a fresh engine: the levels replay the same requests."""
    base, settings = parse_settings(parse_parallel(mode)[0])
    spec = base.partition(":")[0]
    online = settings.get("online", MODE_SETTINGS.get(spec, {}).get("online"))
    return spec == "ngram" or online not in (None, False)


ATTENTION = ("same", "sglang")  # run_sglang's attention: the baseline's decode attention on a CPU


def prefill_attention(attention: str) -> str:
    """The prefill attention every mode of a run with ``attention`` measures: the project's
    (``attend_prefill``) for ``same`` since 2026-12-05 (sglang's before), sglang's for ``sglang``."""
    return "same" if attention == "same" else "sglang"


def run_sglang(mode, target, draft, reqs, levels, max_new, device, dtype, tp_size=1, dp_size=1, eagle3_draft=None,
               temperature=0.0, requests_at=None, on_level=None, attention="same"):
    """One engine for ``mode``, every level of ``levels`` on it (flushed between levels): (rows, outputs
    per level). ``requests_at(c)``: how many of ``reqs`` level c runs (default all); ``on_level(row,
    outputs)`` is called as each level finishes (``bench/load_matrix.py`` checkpoints there).
    ``attention`` (a CPU only): ``"same"`` (default) gives decode forwards the attention code DLITE's
    verify runs and every prefill the project's (the setting ``cpu_attention: "same"``), so no speculation and a
    speculative mode read the KV cache alike; ``"sglang"``: decode and prefill forwards as sglang ships
    them (slower than ours at a batch of several requests, and on radix-cache hits). sglang's EAGLE3
    keeps sglang's own (its draft model's decode steps)."""

    kw = dict(dtype=dtype, max_total_tokens=65536, chunked_prefill_size=8192, max_running_requests=max(levels))
    base_mode, tp_size, dp_size = parse_parallel(mode, tp_size, dp_size)
    kw.update(tp_size=tp_size, dp_size=dp_size)
    base_mode, settings = parse_settings(base_mode)
    spec, _, w = base_mode.partition(":")
    if spec not in ("dlite", "hybrid", "hybrid-fixed", "dlite-only", "dlite-chain", "dlite-online", "ngram",
                    "eagle3", "nospec"):
        raise SystemExit(f"unknown mode {mode!r}: dlite[:W], hybrid[:W], hybrid-fixed[:W], dlite-only[:W], "
                         "dlite-chain[:W], dlite-online[:W], ngram[:W], eagle3[:W] or nospec")
    is_dlite = spec in ("dlite", "hybrid", "hybrid-fixed", "dlite-only", "dlite-chain", "dlite-online")
    tmp = tempfile.mkdtemp(prefix="dlite_lookup_")
    trace, round_log = os.path.join(tmp, "trace.jsonl"), os.path.join(tmp, "rounds.jsonl")
    if attention not in ATTENTION:
        raise SystemExit(f"attention {attention!r}: one of {', '.join(ATTENTION)}")
    saved_env = {k: os.environ.get(k) for k in ("SGLANG_CPU_OMP_THREADS_BIND", ENV_CONFIG)}
    ranks = tp_size * dp_size
    if device == "cpu" and ranks > 1 and not saved_env["SGLANG_CPU_OMP_THREADS_BIND"]:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(ranks)  # sglang: each rank's cores
    if settings and not is_dlite:
        raise SystemExit(f"mode {mode!r}: +key=value serving settings are DLITE's (dlite... modes only)")
    # the DLITE settings, read by the scheduler subprocess at start-up (the CPU stand-ins' by every mode's):
    # the caller's, the attention, the round log (the worker's draft / verify ms per decode round) and the
    # lookup's trace, then the mode's
    cpu_attention = "same" if attention == "same" and spec != "eagle3" else "sglang"
    os.environ[ENV_CONFIG] = json.dumps({**read_config(os.environ.get(ENV_CONFIG)), "cpu_attention": cpu_attention,
                                         "lookup_trace": trace, "round_log": round_log,
                                         **MODE_SETTINGS.get(spec, {}), **settings})
    verify_kw = {"speculative_num_draft_tokens": int(w)} if spec != "nospec" and w else {}
    if spec == "ngram":
        verify_kw = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8, **verify_kw}
    if spec == "eagle3":
        verify_kw = eagle3_kwargs(w, eagle3_draft, target, dtype)
    t0 = time.perf_counter()
    try:
        if device == "cpu":
            e = cpu_launch.start_engine(target, dlite=draft if is_dlite else None, **kw, **verify_kw)
        else:
            import sglang as sgl  # a GPU: sglang itself, no CPU stand-ins

            args = dict(model_path=str(target), dtype=dtype, sleep_on_idle=True, max_running_requests=max(levels),
                        random_seed=0, tp_size=tp_size, dp_size=dp_size, **verify_kw)
            if is_dlite:
                args.update(speculative_algorithm="DLITE", speculative_draft_model_path=str(draft))
            e = sgl.Engine(**args)
    finally:  # the engine's processes have read their environment: the caller's comes back
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
            outs, lat, wall, ttft, itl = e.loop.run_until_complete(run_level(e, level_reqs, c, sp))
            shares, width = trace_stats(trace, mark)
            round_ms = round_stats(round_log, rmark)
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


def jsonl_after(path, offset):
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


def trace_stats(trace, offset):
    """(share of decode rounds per drafting source, mean verify width per round) in the worker's
    lookup trace after ``offset``."""
    cnt, widths = {}, []
    for rec in jsonl_after(trace, offset):
        for s in rec.get("sources") or []:
            cnt[s] = cnt.get(s, 0) + 1
        if rec.get("width"):
            widths.append(int(rec["width"]))
    tot = sum(cnt.values())
    return ({k: round(v / tot, 3) for k, v in sorted(cnt.items())} if tot else {},
            round(sum(widths) / len(widths), 2) if widths else None)


POSITION_BUCKET = 32  # output tokens per bucket of tau by output position


def round_stats(path, offset):
    """Mean draft / verify ms per decode round, the rounds, and acceptance by output position, from the
    worker's round log (the setting ``round_log``) after ``offset``; {} when there is none (no
    speculation); with the setting ``online``, ``online_stats``' fields. ``rounds_by_position``: {bucket
    start: [request-rounds, tokens committed]} for the request-rounds whose output length before the
    round falls in [start, start + POSITION_BUCKET): tau at that depth of the answer = committed /
    request-rounds (``tau_by_position``)."""
    recs = list(jsonl_after(path, offset))
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
            **online_stats(recs),
            **({"rounds_by_position": {str(k): v for k, v in sorted(by_pos.items())}} if by_pos else {})}


def online_stats(recs) -> dict:
    """The online learner's share of the round log's records ``recs`` (the setting ``online``; else {}):
    ``learn_ms_per_round`` and ``online``, its counts summed over these rounds (``online_serving.ROUND_COUNTS``:
    updates, tree-gate rounds on the adapted / the shipped tree, verdicts better / worse, rounds backed off)."""
    if not any("online" in r for r in recs):
        return {}
    counts = {}
    for r in recs:
        for k, v in (r.get("online") or {}).items():
            counts[k] = counts.get(k, 0) + int(v)
    return {"learn_ms_per_round": round(sum(float(r.get("learn_ms", 0)) for r in recs) / len(recs), 2),
            "online": counts}


def pool_rounds_by_position(rows) -> dict:
    """{bucket start: [request-rounds, tokens committed]} summed over ``rows`` (their ``rounds_by_position``)."""
    pooled = {}
    for row in rows:
        for k, (n, committed) in (row.get("rounds_by_position") or {}).items():
            cell = pooled.setdefault(int(k), [0, 0])
            cell[0] += n
            cell[1] += committed
    return dict(sorted(pooled.items()))


def tau_by_position(rows) -> dict:
    """{bucket start: tau} pooled over ``rows`` (their ``rounds_by_position``)."""
    return {k: round(tau(c, n), 3) for k, (n, c) in pool_rounds_by_position(rows).items() if n}


def level_row(mode, concurrency, metas, wall, lat, ttft=(), itl=()) -> dict:
    """One (mode, concurrency) row from its requests' counts, for both engines: ``metas`` are
    sglang's ``meta_info`` (``completion_tokens``, the prefill's token included; ``spec_verify_ct``)
    or the reference engine's same counts (``reference_meta``); tau is ``drafting.tau.tau_of_sglang``."""
    toks = sum(int(m["completion_tokens"]) for m in metas)
    t = tau_of_sglang(metas)
    prefix = {}  # sglang's prompt accounting: how much of the prompts the radix cache served
    if metas and all("prompt_tokens" in m and "cached_tokens" in m for m in metas):
        prompt, cached = sum(int(m["prompt_tokens"]) for m in metas), sum(int(m["cached_tokens"]) for m in metas)
        prefix = {"prompt_tokens": prompt, "cached_prompt_tokens": cached, "prefilled_tokens": prompt - cached}
    return {"mode": mode, "concurrency": concurrency, "requests": len(metas), "output_tokens": toks, **prefix,
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


def paired(runs: dict, ref_mode: str) -> list:
    """Every other mode against ``ref_mode``, repeat by repeat: ``runs`` {mode: [[row per level] per
    repeat]} (``bench/e2e.py``, modes rotated between repeats) -> one row per (mode, level): the median
    over repeats of tokens/s(mode, repeat r) / tokens/s(ref_mode, repeat r), its min-max, and the
    per-round medians (draft, verify, the online learner's ms). Runs of one repeat follow one another
    within minutes, so a drift of the machine's speed over the whole benchmark (on a shared 2-core VM,
    10-25 %) cancels in each ratio that the medians of each mode's own tokens/s keep."""
    out = []
    for mode, reps in runs.items():
        if mode == ref_mode:
            continue
        for lv, level_rows in enumerate(zip(*reps)):
            ref = [rep[lv] for rep in runs[ref_mode][:len(level_rows)]]
            ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(level_rows, ref) if b["tokens_per_s"]]
            if not ratios:
                continue
            per_round = {f"{k}_median": round(median([r[k] for r in level_rows]), 2)
                         for k in ("draft_ms_per_round", "verify_ms_per_round", "learn_ms_per_round")
                         if all(r.get(k) is not None for r in level_rows)}
            out.append({"mode": mode, "vs": ref_mode, "concurrency": level_rows[0]["concurrency"],
                        "paired_ratio": round(median(ratios), 3), "paired_min": round(min(ratios), 3),
                        "paired_max": round(max(ratios), 3), "repeats": len(ratios), **per_round})
    return out
