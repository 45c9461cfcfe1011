"""Soak benchmark of the shipped HTTP server (issue 18): a real ``sglang-dlite serve --cpu`` on
127.0.0.1 (bundled SmolLM2-135M target, the shipped DLite drafter, ``--enable-metrics``) under
mixed traffic plus a chaos client, bounded in time and in requests, stopping by itself.

    nice python bench/soak.py --minutes 4 --tag short          # a few minutes
    nice python bench/soak.py --minutes 16 --cycles 4 --idle 30 --tag long   # the >= 15 minute run

Traffic: ``--clients`` (default 16) concurrent clients, each looping over a seeded mix of greedy,
sampled, penalty, json_schema, stop-string, logprob, streaming (native and OpenAI chat) requests,
explicit aborts (``/abort_request``), client disconnects mid-stream, over-long prompts and invalid
parameters; plus one chaos client that sends every input of ``dlite_lab/benchmarking/bad_requests.py`` in a
loop. Every ``--sample-every`` seconds (default 10) it samples the resident memory (RSS) of the
scheduler, tokenizer/HTTP and detokenizer processes and the KV pool's used tokens
(``/v1/loads``). The load runs in ``--cycles`` cycles; after each it idles ``--idle`` seconds and
reads the KV tokens in use (must be 0) and the scheduler RSS (a leak keeps growing from one idle
point to the next; an allocator high-water mark does not).

Output: a table (requests, errors by kind, p50/p99 latency, tokens/s per request kind), the RSS
slope (MB/min, least squares over the load phase and over its second half: a leak is a slope that
does not flatten), JSON (``--out``, default artifacts/soak/TAG.json) and a PNG plot
(bench/plots/soak_TAG.png). Exit 1 if the server died, a bad input got anything but a 4xx with a
readable message, a valid request failed, or KV tokens are still in use after the idle period.

Only loopback; the server is started and stopped here (its own process group). The scheduler's
torch threads are pinned with ``--threads`` (OMP_NUM_THREADS of the server, default 1: the machine
is shared).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from dlite_lab.benchmarking.agent_client import free_port, stop_process_group
from dlite_lab.benchmarking.bad_requests import BAD_REQUESTS, LEAK_RE, error_message, send
from dlite_lab.benchmarking.soak_report import dlite_metrics, plot, plot_title, print_table, rss_summary, table

REPO = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of Python decorators.",
    "What is the capital of Japan? Answer briefly.",
    "Give me a recipe for pancakes.",
    "Describe the water cycle.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
]
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})
KINDS = ["greedy", "sampled", "penalties", "json_schema", "stop", "logprobs", "stream", "chat", "chat_stream",
         "abort", "disconnect", "over_long", "invalid"]


# ----------------------------------------------------------------------------- the server
class Server:
    def __init__(self, args, log_path: Path):
        from sglang_dlite.serving import serve

        self.port = args.port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        ns = argparse.Namespace(model_path="default", draft=args.draft, no_spec=args.no_spec, cpu=True,
                                dry_run=False, sglang_args=[
                                    "--host", "127.0.0.1", "--port", str(self.port),
                                    "--max-total-tokens", str(args.max_total_tokens),
                                    "--max-running-requests", str(args.max_running), "--skip-server-warmup",
                                    "--sleep-on-idle", "--enable-metrics", "--log-level", "warning"])
        cmd, env = serve.build_command(ns)
        env = dict(env, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        self.cmd = cmd
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(["nice", "-n", str(args.nice)] + cmd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout=900) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during start-up:\n" + self.tail())
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError(f"server did not come up in {timeout} s")

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            return requests.get(self.base + "/health", timeout=60).status_code == 200
        except requests.RequestException:
            return False

    def processes(self) -> dict:
        """{'scheduler': psutil.Process, 'http': ..., 'detokenizer': ...} of the running server."""
        import psutil

        out = {}
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return out
        for p in procs:
            try:
                title = " ".join(p.cmdline())
                name = p.name()
            except psutil.Error:
                continue
            if "scheduler" in title or "scheduler" in name:
                out["scheduler"] = p
            elif "detokenizer" in title or "detokenizer" in name:
                out["detokenizer"] = p
            elif "sglang.launch_server" in title:
                out["http"] = p
        return out

    def tail(self, n=4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self):
        stop_process_group(self.proc)


def kv_used_tokens(base: str):
    """Used KV tokens (not counting the evictable prefix cache), from /v1/loads."""
    try:
        r = requests.get(base + "/v1/loads", params={"include": "core,memory"}, timeout=30)
        body = r.json()
    except (requests.RequestException, ValueError):
        return None
    found = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "num_used_tokens" and isinstance(v, (int, float)):
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(body)
    return sum(found) if found else None


# ----------------------------------------------------------------------------- clients
class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.records = []  # dicts: kind, outcome, latency, tokens
        self.failures = []  # (kind, detail) that fail the run

    def add(self, kind, outcome, latency, tokens=0, detail=None, fail=False):
        with self.lock:
            self.records.append(dict(kind=kind, outcome=outcome, latency=latency, tokens=tokens))
            if fail:
                self.failures.append((kind, outcome, (detail or "")[:300]))


def _gen_body(kind, rng, max_new):
    prompt = rng.choice(PROMPTS)
    sp = {"max_new_tokens": max_new}
    body = {"text": prompt, "sampling_params": sp}
    if kind == "greedy":
        sp.update(temperature=0)
    elif kind == "sampled":
        sp.update(temperature=0.8, top_p=0.9, top_k=50)
    elif kind == "penalties":
        sp.update(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
    elif kind == "json_schema":
        sp.update(temperature=0, json_schema=SCHEMA)
    elif kind == "stop":
        sp.update(temperature=0, stop=["\n", "."])
    elif kind == "logprobs":
        sp.update(temperature=0)
        body.update(return_logprob=True, top_logprobs_num=3)
    return body


def _one(kind, rng, base, s, stats, max_new, client_id, n):
    t0 = time.time()
    try:
        if kind in ("greedy", "sampled", "penalties", "json_schema", "stop", "logprobs"):
            r = s.post(base + "/generate", json=_gen_body(kind, rng, max_new), timeout=600)
            ok = r.status_code == 200
            toks = r.json()["meta_info"]["completion_tokens"] if ok else 0
            if ok and kind == "json_schema":
                json.loads(r.json()["text"]) if r.json()["meta_info"]["finish_reason"]["type"] == "stop" else None
            if ok and kind == "logprobs":
                lp = r.json()["meta_info"]["output_token_logprobs"]
                assert len(lp) == toks, "one logprob per output token"
            stats.add(kind, "ok" if ok else f"http_{r.status_code}", time.time() - t0, toks, r.text, fail=not ok)
        elif kind == "stream":
            body = _gen_body("greedy", rng, max_new)
            body["stream"] = True
            toks = 0
            with s.post(base + "/generate", json=body, stream=True, timeout=600) as r:
                ok = r.status_code == 200
                last = None
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
                        if "error" in last:
                            ok = False
                toks = last["meta_info"]["completion_tokens"] if ok and last else 0
            stats.add(kind, "ok" if ok else f"http_{r.status_code}", time.time() - t0, toks, str(last), fail=not ok)
        elif kind in ("chat", "chat_stream"):
            body = {"model": "default", "max_tokens": max_new, "temperature": rng.choice([0, 0.7]),
                    "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
            if kind == "chat_stream":
                body.update(stream=True, stream_options={"include_usage": True})
                toks, ok = 0, True
                with s.post(base + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
                    ok = r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                ok = False
                            if ev.get("usage"):
                                toks = ev["usage"]["completion_tokens"]
                stats.add(kind, "ok" if ok else f"http_{r.status_code}", time.time() - t0, toks, fail=not ok)
            else:
                r = s.post(base + "/v1/chat/completions", json=body, timeout=600)
                ok = r.status_code == 200
                toks = r.json()["usage"]["completion_tokens"] if ok else 0
                stats.add(kind, "ok" if ok else f"http_{r.status_code}", time.time() - t0, toks, r.text, fail=not ok)
        elif kind == "abort":
            rid = f"soak-{client_id}-{n}"
            res = {}

            def go():
                try:
                    res["r"] = requests.post(base + "/generate", timeout=600, json={
                        "text": rng.choice(PROMPTS), "rid": rid,
                        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}})
                except requests.RequestException as exc:
                    res["e"] = exc

            th = threading.Thread(target=go)
            th.start()
            time.sleep(rng.uniform(0.5, 2.0))
            a = s.post(base + "/abort_request", json={"rid": rid}, timeout=60)
            th.join(600)
            r = res.get("r")
            ok = a.status_code == 200 and r is not None and r.status_code == 200
            toks = r.json()["meta_info"]["completion_tokens"] if ok else 0
            stats.add(kind, "ok" if ok else "abort_failed", time.time() - t0, toks, str(res), fail=not ok)
        elif kind == "disconnect":
            body = _gen_body("sampled", rng, 400)
            body["stream"] = True
            body["sampling_params"]["ignore_eos"] = True
            with s.post(base + "/generate", json=body, stream=True, timeout=600) as r:
                ok = r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    if line:
                        got += 1
                    if got >= rng.randint(1, 4):
                        break
            stats.add(kind, "ok" if ok else f"http_{r.status_code}", time.time() - t0, 0, fail=not ok)
        elif kind == "over_long":
            r = s.post(base + "/generate", timeout=120, json={
                "input_ids": [rng.randint(100, 20000) for _ in range(9000)], "sampling_params": {"max_new_tokens": 4}})
            ok = 400 <= r.status_code < 500 and not LEAK_RE.search(error_message(r))
            stats.add(kind, "refused" if ok else f"http_{r.status_code}", time.time() - t0, 0, r.text, fail=not ok)
        elif kind == "invalid":
            _bad(rng.choice(BAD_REQUESTS), base, s, stats, "invalid", t0)
    except requests.RequestException as exc:
        stats.add(kind, type(exc).__name__, time.time() - t0, 0, repr(exc), fail=True)
    except (ValueError, KeyError, AssertionError) as exc:
        stats.add(kind, "bad_answer", time.time() - t0, 0, repr(exc), fail=True)


def _bad(entry, base, s, stats, kind, t0):
    name, path, body, status, word = entry
    r = send(s, base, path, body, timeout=120)
    msg = error_message(r)
    if isinstance(body, dict) and body.get("stream") and r.text.startswith("data: "):
        try:
            msg = json.loads(r.text.split("\n")[0][6:])["error"]["message"]
        except (ValueError, KeyError):
            pass
    ok = 400 <= r.status_code < 500 and word.lower() in msg.lower() and not LEAK_RE.search(msg)
    stats.add(kind, "refused" if ok else f"{name}:http_{r.status_code}", time.time() - t0, 0,
              f"{name}: {r.status_code} {msg}", fail=not ok)


def _claim(counter, limit: int) -> bool:
    """Take one request from the run's budget (--max-requests), shared by every client thread."""
    with counter["lock"]:
        if counter["n"] >= limit:
            return False
        counter["n"] += 1
        return True


def client(cid, args, base, stats, stop, counter):
    rng = random.Random(args.seed * 1000 + cid)
    s = requests.Session()
    n = 0
    while not stop.is_set() and _claim(counter, args.max_requests):
        kind = rng.choices(KINDS, weights=[3, 3, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1])[0]
        _one(kind, rng, base, s, stats, args.max_new_tokens, cid, n)
        n += 1


def chaos(args, base, stats, stop, counter):
    s = requests.Session()
    i = 0
    while not stop.is_set() and _claim(counter, args.max_requests):
        t0 = time.time()
        try:
            _bad(BAD_REQUESTS[i % len(BAD_REQUESTS)], base, s, stats, "chaos", t0)
        except requests.RequestException as exc:
            stats.add("chaos", type(exc).__name__, time.time() - t0, 0, repr(exc), fail=True)
        i += 1
        time.sleep(args.chaos_pause)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0, help="load duration (the run stops by itself)")
    p.add_argument("--max-requests", type=int, default=20000, help="bound on requests sent (all clients)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--idle", type=float, default=20.0, help="idle seconds after each load cycle before the KV leak check")
    p.add_argument("--cycles", type=int, default=1,
                   help="split the load into this many cycles with an idle period after each: RSS sampled after "
                        "each idle period separates a leak (keeps growing) from an allocator high-water mark (flat)")
    p.add_argument("--chaos-pause", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads of the server")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--draft", default=None)
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="short")
    p.add_argument("--out", default=None, help="JSON (default artifacts/soak/TAG.json)")
    p.add_argument("--plot", default=None, help="PNG (default bench/plots/soak_TAG.png)")
    p.add_argument("--summary", default=None, metavar="RUN.json", help="reprint the table and RSS summary of a run")
    args = p.parse_args(argv)
    if args.summary:
        run = json.loads(Path(args.summary).read_text())
        print_table(run["table"], run["wall_s"])
        rss_summary(run["samples"], run.get("load_ends_s") or [])
        if args.plot:  # re-render the run's plot
            ends = run.get("load_ends_s") or [max((s["t"] for s in run["samples"] if s["phase"] == "load"), default=0)]
            plot(run["samples"], ends, args.plot, plot_title(run["config"]["tag"], run["requests"], run["config"]))
        print(f"KV tokens in use after idle: {run['kv_used_after_idle']}; passed: {run['passed']}")
        return 0 if run["passed"] else 1
    out = Path(args.out or REPO / "artifacts" / "soak" / f"{args.tag}.json")
    png = Path(args.plot or REPO / "bench" / "plots" / f"soak_{args.tag}.png")
    out.parent.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    srv = Server(args, out.with_suffix(".server.log"))
    failures, result = [], {}
    try:
        up = srv.wait_up()
        print(f"server up in {up:.0f} s on {srv.base} (torch threads {args.threads}, nice {args.nice})", flush=True)
        # a few requests to reach the steady state the pre-load sample is taken in
        for kind in ("greedy", "json_schema", "logprobs"):
            requests.post(srv.base + "/generate", json=_gen_body(kind, random.Random(0), 8), timeout=600)
        procs = srv.processes()
        print("processes:", {k: v.pid for k, v in procs.items()}, flush=True)

        stats = Stats()
        counter = {"n": 0, "lock": threading.Lock()}
        samples = []
        t_start = time.time()

        def sample(phase):
            s = {"t": time.time() - t_start, "phase": phase}
            for k, proc in procs.items():
                try:
                    s[f"{k}_mb"] = proc.memory_info().rss / 2**20
                except Exception:
                    s[f"{k}_mb"] = None
            s["kv_used_tokens"] = kv_used_tokens(srv.base)
            with stats.lock:
                s["requests"] = len(stats.records)
            samples.append(s)
            return s

        sample("pre")
        bar = tqdm(total=int(60 * args.minutes), unit="s", desc="soak", mininterval=5)
        died, wall, load_ends, idle_points, kv_checks = False, 0.0, [], [], []
        per_cycle = 60 * args.minutes / args.cycles
        for cycle in range(args.cycles):
            stop = threading.Event()
            threads = [threading.Thread(target=client, args=(i + 100 * cycle, args, srv.base, stats, stop, counter),
                                        daemon=True) for i in range(args.clients)]
            threads.append(threading.Thread(target=chaos, args=(args, srv.base, stats, stop, counter), daemon=True))
            t_load = time.time()
            for th in threads:
                th.start()
            deadline = t_load + per_cycle
            while time.time() < deadline and any(th.is_alive() for th in threads[:-1]):
                time.sleep(min(args.sample_every, max(0.1, deadline - time.time())))
                s = sample("load")
                bar.update(max(0, min(int(wall + time.time() - t_load) - bar.n, bar.total - bar.n)))
                bar.set_postfix(cycle=cycle + 1, req=s["requests"], sched_mb=f"{s.get('scheduler_mb') or 0:.0f}",
                                kv=s["kv_used_tokens"])
                if srv.proc.poll() is not None:
                    died = True
                    break
            stop.set()
            for th in threads:
                th.join(660)
            wall += time.time() - t_load
            load_ends.append(time.time() - t_start)
            if died or not srv.alive():
                died = True
                break
            # idle, keep sampling, then the leak check of this cycle
            t_idle = time.time()
            while time.time() - t_idle < args.idle:
                time.sleep(min(args.sample_every, args.idle))
                last_idle = sample("idle")
            idle_points.append((last_idle["t"], last_idle.get("scheduler_mb")))
            kv_checks.append(kv_used_tokens(srv.base))
            if counter["n"] >= args.max_requests:
                break
        bar.close()
        load_end = load_ends[-1] if load_ends else 0.0
        kv_after_idle = kv_checks[-1] if kv_checks else None
        alive_end = not died and srv.alive()
        dlite = dlite_metrics(srv.base) if alive_end else {}

        rows = table(stats.records, KINDS + ["chaos"], wall)
        print_table(rows, wall)
        rss = rss_summary(samples, load_ends)
        print(f"KV tokens in use after each {args.idle:.0f} s idle period: {kv_checks}")
        if dlite:
            print("DLITE /metrics: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in dlite.items()))
        if not alive_end:
            failures.append("the server died:\n" + srv.tail(2000))
        if stats.failures:
            failures.append(f"{len(stats.failures)} failed requests, first: {stats.failures[:5]}")
        if any(k is None for k in kv_checks) and alive_end:
            failures.append("could not read the KV used tokens after idle")
        elif any(kv_checks):
            failures.append(f"KV leak: tokens still in use after {args.idle:.0f} s idle: {kv_checks}")
        result = dict(
            config=dict(vars(args), torch_threads=args.threads, host=platform.node(), python=platform.python_version(),
                        server_cmd=srv.cmd),
            wall_s=wall, requests=len(stats.records), table=rows, samples=samples, load_ends_s=load_ends,
            scheduler_rss=rss,
            kv_used_after_idle=kv_checks, dlite_metrics=dlite, server_alive=alive_end,
            failures=[str(x)[:2000] for x in failures], failed_requests=stats.failures[:50], passed=not failures,
        )
        plot(samples, load_ends, png, plot_title(args.tag, len(stats.records), vars(args)))
    finally:
        srv.stop()
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nJSON: {out}\nplot: {png}")
    if failures:
        print("FAILED:\n- " + "\n- ".join(f[:600] for f in failures))
        return 1
    print("PASSED: server alive, every bad input refused with a 4xx, no KV tokens in use after idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
