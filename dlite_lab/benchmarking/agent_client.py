"""Agents over the OpenAI API (``bench/agent_client.py``): multi-turn sessions replayed through
``openai.AsyncOpenAI`` against real ``sglang-dlite serve`` servers, the way an agent drives one.

A session is one workload conversation. At each assistant message it sends the whole history so
far (system, user and tool messages from the workload; its own earlier replies in place of the
recorded ones with ``history="own"``, as an agent does, or the recorded ones with
``"recorded"``), streamed with ``stream_options={"include_usage": True, "continuous_usage_stats":
True}``, and the workload's tools as OpenAI ``tools`` (``tools=False``: none). ``sessions``
sessions run concurrently. Per turn it records TTFT (the first chunk that brings a token),
inter-token latencies (a chunk that brings n tokens after a gap g counts n latencies of g / n:
what a reader of the stream sees), tokens/s, ``usage.prompt_tokens_details.cached_tokens`` (the
server's radix-cache hit; needs ``--enable-cache-report``) and τ (``drafting.tau.tau_of_sglang``
over sglang's ``sglext.spec_tokens_details``, asked per request with ``return_spec_tokens_details``).

Servers (``Server.start``): ``sglang-dlite serve --cpu`` on 127.0.0.1 and a free port, one per mode:
``dlite`` (the default DLITE server), ``nospec`` (``--no-spec``) and ``ngram`` (sglang's NGRAM with 8
draft tokens); or ``Server.attach(base_url)`` for a server a user already runs. Requests are bounded
(``max_turns`` per session, ``max_new_tokens`` per turn, a timeout per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

from sglang_dlite.drafting.tau import tau, tau_of_sglang
from sglang_dlite.errors import DLiteInputError, MissingDependencyError
from dlite_lab.benchmarking.sglang_runs import percentile

MODES = ("dlite", "nospec", "ngram")
NGRAM_ARGS = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
REQUEST_TIMEOUT_S = 600.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (benchmark and test servers listen on loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    """End a server started with ``start_new_session=True`` and its children: SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


@dataclass
class Server:
    """One OpenAI-compatible server: started here (``start``) or a user's (``attach``)."""

    base: str  # http://127.0.0.1:PORT
    mode: str
    proc: Optional[subprocess.Popen] = None
    log_path: Optional[str] = None

    @classmethod
    def attach(cls, base_url: str, mode: str = "server") -> "Server":
        return cls(base_url.rstrip("/").removesuffix("/v1"), mode)

    @classmethod
    def start(cls, mode: str, log_dir: str, *, dtype: str = "bfloat16", max_running: int = 8,
              extra: tuple = (), env: Optional[dict] = None, timeout_s: float = 900.0) -> "Server":
        """``sglang-dlite serve --cpu`` for ``mode`` (``MODES``), loopback only; returns once ``/health`` answers.
        ``env``: variables set for the server on top of the launcher's (e.g. its torch threads)."""
        from sglang_dlite.serving import serve  # the launcher's sglang/transformers imports: only to start one

        if mode not in MODES:
            raise DLiteInputError(f"mode {mode!r}: one of {', '.join(MODES)}.")
        port = free_port()
        sglang_args = ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enable-cache-report",
                       "--max-running-requests", str(max_running), "--log-level", "warning",
                       *(NGRAM_ARGS if mode == "ngram" else []), *extra]
        p = argparse.ArgumentParser()
        serve.add_arguments(p)
        args = p.parse_args(["--cpu", *(["--no-spec"] if mode != "dlite" else []), "--", *sglang_args])
        cmd, launch_env = serve.build_command(args)  # with /metrics, the bundled target's tool-call parser
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"server_{mode}_{port}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env={**launch_env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        srv = cls(f"http://127.0.0.1:{port}", mode, proc, log_path)
        srv.wait_ready(timeout_s)
        return srv

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the {self.mode} server exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the {self.mode} server did not answer /health in {timeout_s:.0f} s:\n{self.log_tail()}")

    def flush_cache(self, tries: int = 50) -> None:
        """Empty the radix cache (retried while a request is still retiring): every level starts cold."""
        for _ in range(tries):
            try:
                req = urllib.request.Request(self.base + "/flush_cache", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the {self.mode} server refused to flush its cache")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            return r.read().decode()

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        self.proc = None


@dataclass
class TurnRecord:
    session: int
    turn: int  # 1-based within the session
    conv_id: str
    prompt_tokens: int = 0
    cached_tokens: Optional[int] = None
    completion_tokens: int = 0
    ttft_s: Optional[float] = None
    latency_s: float = 0.0
    itl_s: list = field(default_factory=list)
    spec_verify_ct: Optional[int] = None
    finish_reason: Optional[str] = None
    text: str = ""
    tool_calls: list = field(default_factory=list)

    @property
    def tau(self) -> Optional[float]:
        if not self.spec_verify_ct:
            return None
        return tau_of_sglang([{"completion_tokens": self.completion_tokens, "spec_verify_ct": self.spec_verify_ct}])

    @property
    def tokens_per_s(self) -> float:
        out = self.completion_tokens  # output tokens per second of the turn's whole latency
        return out / self.latency_s if self.latency_s > 0 else 0.0

    def row(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "itl_s"}
        d.update(tau=self.tau, tokens_per_s=round(self.tokens_per_s, 3),
                 itl_ms_mean=round(1e3 * sum(self.itl_s) / len(self.itl_s), 3) if self.itl_s else None)
        return d


def _openai():
    try:
        import openai  # optional dependency: said what to install below
    except ImportError as exc:
        raise MissingDependencyError("the agent benchmark needs the openai client: pip install 'openai>=1.40'") from exc
    return openai


def _client_message(m: dict) -> dict:
    """A workload message as an OpenAI client sends it."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    for k in ("name", "tool_call_id"):
        if m.get(k):
            out[k] = m[k]
    return out


async def run_session(client, conv: dict, session: int, *, max_turns: int, max_new_tokens: int,
                      tools: bool = True, history: str = "own", temperature: float = 0.0) -> list:
    """One conversation, turn after turn, each sending the whole history so far: its ``TurnRecord`` s."""
    msgs, sent, out = conv["messages"], [], []
    for j, m in enumerate(msgs + [None]):
        if m is not None and m["role"] != "assistant":
            sent.append(_client_message(m))
            continue
        if m is None and (not msgs or msgs[-1]["role"] == "assistant"):
            break  # the conversation ends on a recorded reply: no final generated turn
        if len(out) >= max_turns or not sent:
            break
        rec = TurnRecord(session, len(out) + 1, str(conv.get("id", session)))
        kw = {"tools": conv["tools"]} if tools and conv.get("tools") else {}
        t0 = last_t = time.perf_counter()
        last_n, calls = 0, {}
        stream = await client.chat.completions.create(
            model="default", messages=sent, max_tokens=max_new_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_spec_tokens_details": True}, timeout=REQUEST_TIMEOUT_S, **kw)
        async for chunk in stream:
            now = time.perf_counter()
            for ch in chunk.choices or ():
                rec.text += ch.delta.content or ""
                for tc in ch.delta.tool_calls or ():
                    c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function is not None:
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
                rec.finish_reason = ch.finish_reason or rec.finish_reason
            usage = chunk.usage
            if usage is not None:
                n = int(usage.completion_tokens or 0)
                if n > last_n:
                    if last_n == 0:
                        rec.ttft_s = now - t0
                    else:
                        rec.itl_s.extend([(now - last_t) / (n - last_n)] * (n - last_n))
                    last_t, last_n = now, n
                rec.prompt_tokens, rec.completion_tokens = int(usage.prompt_tokens or 0), n
                details = getattr(usage, "prompt_tokens_details", None)
                if details is not None and getattr(details, "cached_tokens", None) is not None:
                    rec.cached_tokens = int(details.cached_tokens)
            ext = getattr(chunk, "sglext", None) or (chunk.model_extra or {}).get("sglext")
            spec = (ext or {}).get("spec_tokens_details") if isinstance(ext, dict) else None
            if isinstance(spec, list):
                spec = spec[0] if spec else None
            if spec:
                rec.spec_verify_ct = int(spec.get("spec_verify_ct") or 0) or None
        rec.latency_s = time.perf_counter() - t0
        rec.tool_calls = [calls[i] for i in sorted(calls)]
        out.append(rec)
        if m is None:
            break
        if history == "own":
            reply = {"role": "assistant", "content": rec.text}
            if rec.tool_calls:
                reply["tool_calls"] = [{"id": f"call_{session}_{j}_{i}", "type": "function", "function": c}
                                       for i, c in enumerate(rec.tool_calls)]
            sent.append(reply)
        else:
            sent.append(_client_message(m))
    return out


async def run_level(base: str, convs: list, sessions: int, **kw) -> tuple:
    """``sessions`` sessions at once over the first ``sessions`` conversations (cycled): (turns, wall s)."""
    openai = _openai()
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        t0 = time.perf_counter()
        per = await asyncio.gather(*(run_session(client, convs[i % len(convs)], i, **kw) for i in range(sessions)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return [t for s in per for t in s], wall


def summarize(turns: list, wall_s: float) -> dict:
    """Overall and per-turn figures of one level: tokens/s (all completion tokens over the wall time),
    TTFT / ITL / per-turn tokens/s p50 and p95, τ (the rounds-weighted one), turn >= 2 TTFT p50."""
    ttft = [t.ttft_s for t in turns if t.ttft_s is not None]
    later = [t.ttft_s for t in turns if t.ttft_s is not None and t.turn >= 2]
    itl = [x for t in turns for x in t.itl_s]
    tps = [t.tokens_per_s for t in turns]
    spec = [t for t in turns if t.spec_verify_ct]
    rounds = sum(t.spec_verify_ct for t in spec)
    r = lambda x, k=4: None if x is None else round(x, k)  # noqa: E731
    out = sum(t.completion_tokens for t in turns)
    return {
        "turns": len(turns), "completion_tokens": out, "wall_s": r(wall_s, 3),
        "tokens_per_s": r(out / wall_s if wall_s > 0 else None, 3),
        "ttft_p50_s": r(percentile(ttft, 50)), "ttft_p95_s": r(percentile(ttft, 95)),
        "ttft_turn2plus_p50_s": r(percentile(later, 50)),
        "itl_p50_ms": r(None if not itl else 1e3 * percentile(itl, 50), 3),
        "itl_p95_ms": r(None if not itl else 1e3 * percentile(itl, 95), 3),
        "turn_tokens_per_s_p50": r(percentile(tps, 50), 3), "turn_tokens_per_s_p95": r(percentile(tps, 95), 3),
        "tau": r(tau(sum(t.completion_tokens - 1 for t in spec), rounds)),
        "cached_tokens": sum(t.cached_tokens or 0 for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
    }


def parity(turns: list, baseline: list) -> dict:
    """Per (session, turn) against the baseline (no speculation): outputs identical, and, for every
    turn >= 2 whose history is identical (every earlier reply of its session equal), cached tokens
    identical (``cache_compared`` how many were compared). One difference is not a miss: where the
    previous turn stopped at ``max_tokens`` on a token that a verify round had computed (an accepted
    draft), its KV exists and the radix cache holds one token more than plain decoding's (whose last
    token never runs through the target): ``cached_plus_one_at_length_stop``. Anything else is a
    mismatch (``cached_tokens_mismatches``)."""
    base = {(t.session, t.turn): t for t in baseline}
    cached_diff, text_diff, compared, seam, diverged, prev = [], [], 0, 0, set(), {}
    for t in sorted(turns, key=lambda t: (t.session, t.turn)):
        before, prev[t.session] = prev.get(t.session), t
        b = base.get((t.session, t.turn))
        if b is None:
            diverged.add(t.session)
            continue
        if t.turn >= 2 and t.session not in diverged:
            compared += 1
            if (t.cached_tokens is not None and b.cached_tokens is not None and t.cached_tokens == b.cached_tokens + 1
                    and before is not None and before.finish_reason == "length"):
                seam += 1
            elif t.cached_tokens != b.cached_tokens:
                cached_diff.append({"session": t.session, "turn": t.turn, "cached": t.cached_tokens,
                                    "baseline": b.cached_tokens})
        if (t.text, t.tool_calls) != (b.text, b.tool_calls):
            text_diff.append({"session": t.session, "turn": t.turn})
            diverged.add(t.session)
    return {"requests": len(turns), "cache_compared": compared, "cached_tokens_mismatches": len(cached_diff),
            "cached_plus_one_at_length_stop": seam, "output_mismatches": len(text_diff), "cached_examples": cached_diff[:5], "output_examples": text_diff[:5]}


def metric_total(text: str, name: str) -> float:
    """The sum over label sets of a Prometheus counter/gauge ``name`` in /metrics text."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([-+0-9.eE]+|NaN)$")
    return sum(float(m.group(2)) for line in text.splitlines() if (m := pat.match(line)) and m.group(2) != "NaN")


def median_rows(rows: list) -> dict:
    """The per-key median of numeric fields over repeats (other fields from the first)."""
    out = dict(rows[0])
    for k, v in rows[0].items():
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if isinstance(v, (int, float)) and len(vals) == len(rows):
            out[k] = round(median(vals), 4)
    out["repeats"] = len(rows)
    return out


def write_json(path: str, payload) -> str:
    """``payload`` as JSON at ``path``, atomically (a temporary file, then a rename); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
    return path


def python_info() -> dict:
    return {"python": sys.version.split()[0], "argv": sys.argv}
