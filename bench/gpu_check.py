"""One command for a lent GPU machine: every GPU path that needs no sglang, in order of value,
within an internal deadline (docs/gpu_check.md).

    OUT=/tmp/out bash bench/gpu_check.sh          # = python3 bench/gpu_check.py --out $OUT
    python3 bench/gpu_check.py --list             # the step table

Steps (``STEPS``; each has a budget in seconds and is skipped when its budget exceeds the time
left before the deadline, default 500 s; without CUDA every GPU step is "skipped: no CUDA"):

    probe          versions, the GPU and its limits, the CUDA tools
    build_ext      (in the background) the extension with the CUDA ops: python -m sglang_dlite.ops.build
    sanitizer      csrc/cuda/dlite_cuda.cu built standalone by nvcc, its plain C launchers driven on small
                   shapes (bench/gpu_kernel_driver.py, vs ops/reference.py) under compute-sanitizer
                   memcheck, racecheck and synccheck
    op_tests       python_tests/ops/test_ops_cuda.py: the CUDA ops vs the reference (waits for build_ext)
    cuda_graphs    the drafter's CUDA graphs bitwise == eager at every bucket size (bench/gpu_steps.py graphs)
    draft_latency  batch 1/8/32 x context 512/32k, torch vs CUDA ops vs CUDA graphs, the draft round as a
                   fraction of a verify forward (bench/draft_latency.py)
    engine         the reference engine on CUDA in float32 with the CUDA ops: greedy output == the
                   target's (bench/gpu_steps.py engine)
    train          a 100-step training smoke on CUDA (gen-data and the lossless check on CUDA too)
    ncu            per-kernel Nsight Compute metrics of the standalone kernels, if time is left

Only three files go to --out: ``summary.json`` (rewritten at every step start and end, so a run
killed from outside still returns what ran), ``draft_latency.json`` and ``logs.tar.gz`` (every
step's log and JSON record). Exit status 0 when no step failed or timed out (skipped steps are
not failures: the dry run on a machine without CUDA passes).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 500.0
OUT_FILES = ("summary.json", "draft_latency.json", "logs.tar.gz")
LOG_FILE_CAP = 3 * 2**20  # bytes of one log kept in logs.tar.gz (head and tail)
TAR_CAP = 12 * 2**20  # bytes of logs packed at most (the machine returns <= 16 MiB a file)
NCU_METRICS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed")


@dataclass
class Step:
    name: str
    budget_s: float
    what: str
    fn: Callable  # fn(check, step) -> dict with "status" (and any results)
    needs_cuda: bool = True


@dataclass
class StepRecord:
    name: str
    what: str
    budget_s: float
    status: str = "pending"
    seconds: Optional[float] = None
    started_at_s: Optional[float] = None
    result: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"name": self.name, "status": self.status, "budget_s": self.budget_s, "seconds": self.seconds,
             "started_at_s": self.started_at_s, "what": self.what}
        d.update(self.result)
        return d


def failed(status: str) -> bool:
    return status.startswith(("fail", "timeout", "killed"))


def find_tool(name: str) -> Optional[str]:
    """A CUDA tool on PATH, else under $CUDA_HOME / /usr/local/cuda (bin/ or its own folder)."""
    p = shutil.which(name)
    if p:
        return p
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots += sorted(str(p) for p in Path("/usr/local").glob("cuda-*"))
    for root in filter(None, roots):
        for cand in (Path(root) / "bin" / name, Path(root) / name / name):
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


class GpuCheck:
    """Runs the steps in order under one deadline; rewrites summary.json at every step."""

    def __init__(self, out: str, work: str, steps: list, deadline_s: float = DEADLINE_S, no_cuda: bool = False,
                 python: str = sys.executable, argv: Optional[list] = None):
        self.out, self.work = Path(out), Path(work)
        self.logs = self.work / "logs"
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.steps = steps
        self.deadline_s = deadline_s
        self.force_no_cuda = no_cuda
        self.python = python
        self.argv = argv or []
        self.t0 = time.monotonic()
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.records = [StepRecord(s.name, s.what, s.budget_s) for s in steps]
        self.cuda = False
        self.probe: dict = {}
        self.children: set = set()
        self.build: Optional[dict] = None  # the background build_ext: {"proc", "deadline", "log", "record"}
        self.finished = False
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = str(REPO) + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.env.setdefault("SGLANG_DLITE_CACHE", str(self.work / "cache"))
        self.env["PYTHONUNBUFFERED"] = "1"

    # ------------------------------------------------------------------ time
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    # ------------------------------------------------------------------ outputs
    def summary(self) -> dict:
        statuses = [r.status for r in self.records]
        return {
            "check": "bench/gpu_check.py", "command": " ".join(["bench/gpu_check.py", *self.argv]),
            "started_utc": self.started, "deadline_s": self.deadline_s, "elapsed_s": round(self.elapsed(), 1),
            "finished": self.finished, "cuda": self.cuda,
            "ok": not any(failed(s) for s in statuses),
            "all_steps_ok": all(s == "ok" for s in statuses),
            "counts": {k: sum(1 for s in statuses if s.split(":")[0] == k)
                       for k in ("ok", "fail", "timeout", "skipped", "pending", "running", "killed")},
            "steps": [r.to_dict() for r in self.records],
            "files": list(OUT_FILES), "work": str(self.work),
        }

    def _place(self, src: Path, name: str):
        dst = self.out / name
        try:
            os.replace(src, dst)
        except OSError:  # another file system: copy (no temporary file in --out)
            shutil.copyfile(src, dst)
            src.unlink()

    def write_summary(self):
        tmp = self.work / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary(), indent=1, default=str))
        self._place(tmp, "summary.json")

    def pack_logs(self):
        tmp = self.work / "logs.tar.gz.tmp"
        total = 0
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(self.logs.rglob("*")):
                if not f.is_file():
                    continue
                size = f.stat().st_size
                if total + min(size, LOG_FILE_CAP) > TAR_CAP:
                    continue
                arc = "logs/" + str(f.relative_to(self.logs))
                if size <= LOG_FILE_CAP:
                    tar.add(f, arcname=arc)
                    total += size
                else:  # head and tail of a huge log
                    with open(f, "rb") as fh:
                        head = fh.read(LOG_FILE_CAP // 3)
                        fh.seek(size - 2 * LOG_FILE_CAP // 3)
                        tail = fh.read()
                    data = head + f"\n[... {size - len(head) - len(tail)} bytes cut ...]\n".encode() + tail
                    info = tarfile.TarInfo(arc)
                    info.size, info.mtime = len(data), int(time.time())
                    tar.addfile(info, io.BytesIO(data))
                    total += len(data)
        self._place(tmp, "logs.tar.gz")

    def say(self, msg: str):
        print(f"[gpu_check +{self.elapsed():5.0f}s] {msg}", flush=True)

    # ------------------------------------------------------------------ processes
    def log_path(self, name: str) -> Path:
        return self.logs / name

    def start(self, cmd: list, log: Path, env: Optional[dict] = None) -> subprocess.Popen:
        with open(log, "ab") as f:
            f.write(f"$ {shlex.join(map(str, cmd))}\n".encode())
            f.flush()
            p = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                 env=env or self.env, start_new_session=True)
        self.children.add(p)
        return p

    def wait(self, p: subprocess.Popen, timeout: float) -> Optional[int]:
        """The exit code, or None after killing its process group at the timeout."""
        try:
            return p.wait(timeout=max(timeout, 0.5))
        except subprocess.TimeoutExpired:
            self.kill(p)
            return None
        finally:
            if p.returncode is not None:
                self.children.discard(p)

    def kill(self, p: subprocess.Popen):
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        self.children.discard(p)

    def run(self, cmd: list, log: Path, timeout: float, env: Optional[dict] = None) -> tuple:
        """(exit code or None on timeout, seconds)."""
        t = time.monotonic()
        rc = self.wait(self.start(cmd, log, env), timeout)
        with open(log, "ab") as f:
            f.write(f"[exit {rc if rc is not None else 'timeout'} after {time.monotonic() - t:.1f} s]\n".encode())
        return rc, round(time.monotonic() - t, 1)

    # ------------------------------------------------------------------ the background build
    def build_state(self, wait_s: float = 0.0) -> str:
        """'ok' | 'fail' | 'timeout' | 'running' | 'not started' (waits up to wait_s for a running build)."""
        b = self.build
        if b is None:
            return "not started"
        rec = b["record"]
        if rec.status == "running":
            wait = min(wait_s, b["deadline"] - time.monotonic())
            try:  # waiting here does not stop the build: later steps use it once it is done
                rc = b["proc"].wait(timeout=wait) if wait > 0 else b["proc"].poll()
            except subprocess.TimeoutExpired:
                rc = None
            if rc is None and time.monotonic() >= b["deadline"]:
                self.kill(b["proc"])
                rec.status = "timeout"
            elif rc is not None:
                self.children.discard(b["proc"])
                rec.status = "ok" if rc == 0 else f"fail: exit {rc} (see logs/build_ext.log)"
                rec.result["rc"] = rc
            if rec.status != "running":
                rec.seconds = round(time.monotonic() - b["t0"], 1)
                rec.result["last_line"] = _last_line(b["log"])
                self.write_summary()
        return rec.status

    # ------------------------------------------------------------------ the run
    def run_all(self) -> int:
        self.say(f"{len(self.steps)} steps, deadline {self.deadline_s:.0f} s; work folder {self.work}")
        self.write_summary()
        for step, rec in zip(self.steps, self.records):
            if rec.status != "pending":  # the background build settles its own record
                continue
            if step.needs_cuda and not self.cuda:
                rec.status = "skipped: no CUDA" + (" (--no-cuda)" if self.force_no_cuda else "")
            elif step.budget_s > self.left():
                rec.status = f"skipped: budget {step.budget_s:.0f} s > {max(self.left(), 0):.0f} s left"
            else:
                rec.status, rec.started_at_s = "running", round(self.elapsed(), 1)
                self.write_summary()
                self.say(f"{step.name}: {step.what} (budget {step.budget_s:.0f} s)")
                t = time.monotonic()
                try:
                    res = step.fn(self, step) or {}
                except Exception as exc:  # a bug in a step must not lose the summary
                    res = {"status": f"fail: {type(exc).__name__}: {exc}"}
                rec.status = res.pop("status", "ok")
                rec.result.update(res)
                if rec.status != "running":
                    rec.seconds = round(time.monotonic() - t, 1)
            self.say(f"{step.name}: {rec.status}")
            self.write_summary()
            self.pack_logs()
        if self.build is not None and self.build_state() == "running":
            self.kill(self.build["proc"])
            self.build["record"].status = "skipped: still running after the last step (stopped)"
        self.finished = True
        self.write_summary()
        self.pack_logs()
        s = self.summary()
        self.say(f"done in {s['elapsed_s']} s: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items() if v)
                 + f"; {self.out / 'summary.json'}")
        return 0 if s["ok"] else 1

    def interrupted(self, signum):
        for p in list(self.children):
            self.kill(p)
        for rec in self.records:
            if rec.status == "running":
                rec.status = f"killed: signal {signum}"
        self.write_summary()
        self.pack_logs()


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tool_version(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _python_has(check: GpuCheck, module: str) -> bool:
    v = check.probe.get("versions", {})
    key = {"transformers": "transformers", "pytest": "pytest"}.get(module)
    if key and key in v:
        return v[key] is not None
    return subprocess.run([check.python, "-c", f"import {module}"], capture_output=True, env=check.env).returncode == 0


def _step_deadline(step: Step, t_start: float, check: GpuCheck) -> float:
    return min(t_start + step.budget_s, check.t0 + check.deadline_s)


def _status_of(rc: Optional[int], ok: bool = True, why: str = "") -> str:
    if rc is None:
        return "timeout"
    if rc == 0 and ok:
        return "ok"
    return "fail" + (f": {why}" if why else f": exit {rc}")


# ---------------------------------------------------------------------------------- the steps
def step_probe(check: GpuCheck, step: Step) -> dict:
    out = check.logs / "probe.json"
    rc, s = check.run([check.python, "bench/gpu_steps.py", "probe", "--out", out], check.log_path("probe.log"),
                      step.budget_s - 5)
    rec = _read_json(out) or {}
    check.probe = rec
    tools = {n: find_tool(n) for n in ("nvcc", "compute-sanitizer", "ncu", "nvidia-smi", "cuobjdump")}
    rec["tools"] = {n: {"path": p, "version": _tool_version(p) if n != "nvidia-smi" else None} for n, p in tools.items()}
    if tools["nvidia-smi"]:
        try:
            rec["nvidia_smi"] = subprocess.run(
                [tools["nvidia-smi"], "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,mig.mode.current",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            rec["nvidia_smi"] = f"error: {exc}"
    du = shutil.disk_usage(check.work)
    rec["work_disk_free_gb"] = round(du.free / 2**30, 1)
    rec["deadline_s"] = check.deadline_s
    check.cuda = bool(rec.get("cuda_available")) and not check.force_no_cuda
    (check.logs / "probe.json").write_text(json.dumps(rec, indent=1, default=str))
    keep = {k: rec.get(k) for k in ("python", "torch_cuda", "cuda_available", "gpu", "versions", "cpu_count",
                                     "memory_gb", "nvidia_smi")}
    keep["tools"] = {n: t["version"] if t["path"] else None for n, t in rec["tools"].items()}
    return {"status": _status_of(rc, bool(rec.get("ok")), "the probe failed (see logs/probe.log)"), **keep}


def step_build_ext(check: GpuCheck, step: Step) -> dict:
    if not find_tool("nvcc"):
        return {"status": "skipped: no nvcc (the CUDA ops cannot be built)"}
    env = dict(check.env)
    nvcc = find_tool("nvcc")
    env["PATH"] = str(Path(nvcc).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("CUDA_HOME", str(Path(nvcc).parent.parent))
    log = check.log_path("build_ext.log")
    rec = next(r for r in check.records if r.name == step.name)
    t = time.monotonic()
    check.build = {"proc": check.start([check.python, "-m", "sglang_dlite.ops.build"], log, env), "t0": t,
                   "deadline": _step_deadline(step, t, check), "log": log, "record": rec}
    return {"status": "running", "note": "in the background; op_tests waits for it"}


def _cuda_arch(check: GpuCheck) -> str:
    cap = (check.probe.get("gpu") or {}).get("capability", "9.0")
    major, minor = (int(x) for x in cap.split("."))
    return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def _build_kernel_lib(check: GpuCheck, deadline: float) -> tuple:
    """(path or None, {"rc", "seconds", "arch"}): csrc/cuda/dlite_cuda.cu as a shared library."""
    lib, src = check.work / "libdlite_cuda.so", REPO / "csrc" / "cuda" / "dlite_cuda.cu"
    if lib.is_file() and lib.stat().st_mtime >= src.stat().st_mtime:
        return lib, {"rc": 0, "seconds": 0.0, "arch": f"sm_{_cuda_arch(check)}", "note": "reused"}
    arch = _cuda_arch(check)
    cmd = [find_tool("nvcc"), "-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17", "-lineinfo",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", lib, "csrc/cuda/dlite_cuda.cu"]
    rc, s = check.run(cmd, check.log_path("kernel_lib_nvcc.log"), deadline - time.monotonic())
    return (lib if rc == 0 else None), {"rc": rc, "seconds": s, "arch": f"sm_{arch}"}


def step_sanitizer(check: GpuCheck, step: Step) -> dict:
    nvcc, cs = find_tool("nvcc"), find_tool("compute-sanitizer")
    if not nvcc:
        return {"status": "skipped: no nvcc"}
    if not cs:
        return {"status": "skipped: no compute-sanitizer"}
    deadline = _step_deadline(step, time.monotonic(), check)
    lib, build = _build_kernel_lib(check, deadline)
    res = {"nvcc": build, "runs": {}}
    if lib is None:
        return {"status": "timeout" if build["rc"] is None else "fail: nvcc could not build the kernel library", **res}
    driver = [check.python, "bench/gpu_kernel_driver.py", "--lib", lib]
    # API errors torch's own calls may return are not the kernels' (each launcher's return code is
    # checked by the driver); the driver imports torch before CUDA starts (the 10 s default launch
    # timeout is short beside a busy build); an older compute-sanitizer without these options runs without them
    extra = ["--report-api-errors", "no", "--print-limit", "20", "--launch-timeout", "120"]
    runs = [("plain", None)] + [(tool, tool) for tool in ("memcheck", "racecheck", "synccheck")]
    status = "ok"
    for name, tool in runs:
        left = deadline - time.monotonic()
        if left < 5:
            res["runs"][name] = {"status": "skipped: step budget spent"}
            status = "timeout" if status == "ok" else status
            continue
        log = check.log_path(f"sanitizer_{name}.log")
        out = check.logs / f"kernels_{name}.json"
        prefix = [] if tool is None else [cs, "--tool", tool, "--error-exitcode", "1", *extra]
        rc, s = check.run(prefix + driver + ["--json", out], log, left)
        text = log.read_text(errors="replace") if log.is_file() else ""
        if tool and rc not in (0, None) and extra and re.search(r"(?i)(unrecognized|unknown|invalid).{0,80}option", text):
            extra = []
            rc, s = check.run([cs, "--tool", tool, "--error-exitcode", "1"] + driver + ["--json", out], log,
                              deadline - time.monotonic())
            text = log.read_text(errors="replace")
        m = re.findall(r"ERROR SUMMARY: (\d+) error", text) or re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)
        drv = _read_json(out) or {}
        res["runs"][name] = {"rc": rc, "seconds": s, "errors": int(m[-1]) if m else None,
                             "cases": drv.get("cases"), "cases_failed": drv.get("failed")}
        if rc is None and status == "ok":
            status = f"timeout: {name}"
        elif rc not in (0, None) and status == "ok":
            status = f"fail: {name} (exit {rc}, see logs/sanitizer_{name}.log)"
    return {"status": status, **res}


def step_op_tests(check: GpuCheck, step: Step) -> dict:
    deadline = _step_deadline(step, time.monotonic(), check)
    build = check.build_state(wait_s=deadline - time.monotonic() - 30)
    if build == "running":
        return {"status": "timeout: build_ext still running", "build_ext": build}
    if build == "not started" and not find_tool("nvcc"):
        return {"status": "skipped: no nvcc (the CUDA ops cannot be built)", "build_ext": build}
    if build not in ("ok", "not started"):  # not started: --skip build_ext, an extension built earlier
        return {"status": f"fail: the CUDA ops are not built (build_ext: {build})", "build_ext": build}
    if not _python_has(check, "pytest"):
        return {"status": "skipped: pytest is not installed", "build_ext": build}
    xml = check.logs / "op_tests.xml"
    rc, s = check.run([check.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "python_tests/ops/test_ops_cuda.py",
                       f"--junitxml={xml}"], check.log_path("op_tests.log"), deadline - time.monotonic())
    counts = _junit_counts(xml)
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    return {"status": _status_of(rc, ran > 0, "no test ran (see logs/op_tests.log)" if rc == 0 else ""),
            "build_ext": build, "tests": counts, "pytest_s": s}


def _junit_counts(xml: Path) -> dict:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _cuda_ops_flag(check: GpuCheck) -> list:
    return ["--require-cuda-ops"] if check.build_state() == "ok" else []


def step_cuda_graphs(check: GpuCheck, step: Step) -> dict:
    out = check.logs / "cuda_graphs.json"
    rc, s = check.run([check.python, "bench/gpu_steps.py", "graphs", "--out", out, *_cuda_ops_flag(check)],
                      check.log_path("cuda_graphs.log"), step.budget_s)
    rec = _read_json(out) or {}
    brief = {d: {"buckets": r.get("buckets"), "impl": r.get("impl"), "capture_s": r.get("capture_s"),
                 "all_bitwise_equal": all(all(v.values()) for v in r.get("per_bucket", {}).values()),
                 "not_equal_at": [bs for bs, v in r.get("per_bucket", {}).items() if not all(v.values())]}
             for d, r in rec.get("dtypes", {}).items()}
    return {"status": _status_of(rc, bool(rec.get("ok")), "graph != eager (see logs/cuda_graphs.json)"),
            "dtypes": brief, "cuda_ops_required": rec.get("cuda_ops_required")}


def step_draft_latency(check: GpuCheck, step: Step) -> dict:
    impls = "torch,cuda,graph" if check.build_state() == "ok" else "torch,graph"
    out = check.out / "draft_latency.json"
    rc, s = check.run([check.python, "bench/draft_latency.py", "--drafter", "dlite", "--impl", impls,
                       "--device", "cuda", "--dtype", "bfloat16", "--batch-sizes", "1,8,32", "--contexts", "512,32768",
                       "--reps", "20", "--warmup", "5", "--out", out, "--png", check.logs / "draft_latency.png"],
                      check.log_path("draft_latency.log"), step.budget_s)
    rec = _read_json(out) or {}
    rows = [{"batch": r["batch"], "context": r["context"], "ms": {k: round(v, 3) for k, v in r["ms"].items()},
             "verify_ms": round(r["verify_ms"], 3) if "verify_ms" in r else None,
             "draft_fraction_of_verify": {k: round(v, 4) for k, v in r.get("draft_fraction_of_verify", {}).items()}}
            for r in rec.get("results", [])]
    return {"status": _status_of(rc, bool(rows), "no result"), "impls": impls, "rows": rows,
            "file": "draft_latency.json"}


def step_engine(check: GpuCheck, step: Step) -> dict:
    if not _python_has(check, "transformers"):
        return {"status": "skipped: transformers is not installed (the reference engine runs HF targets)"}
    out = check.logs / "engine.json"
    rc, s = check.run([check.python, "bench/gpu_steps.py", "engine", "--device", "cuda", "--out", out,
                       *_cuda_ops_flag(check)], check.log_path("engine.log"), step.budget_s)
    rec = _read_json(out) or {}
    keep = {k: rec.get(k) for k in ("device", "dlite_identical", "no_spec_identical", "oracle_identical", "devices_ok",
                                     "impl", "cuda_ops_required", "dlite_tau", "oracle_tau", "first_difference")}
    return {"status": _status_of(rc, bool(rec.get("ok")), "output != the target's (see logs/engine.json)"), **keep}


def step_train(check: GpuCheck, step: Step) -> dict:
    if not _python_has(check, "transformers"):
        return {"status": "skipped: transformers is not installed"}
    run_dir = check.work / "train"
    rc, s = check.run([check.python, "-m", "dlite_lab.training.smoke", "--out", run_dir, "--procs", "1",
                       "--device", "cuda", "--steps", "100", "--hidden", "256", "--layers", "4"],
                      check.log_path("train.log"), step.budget_s)
    rec = _read_json(run_dir / "smoke.json") or {}
    if rec:
        (check.logs / "train_smoke.json").write_text(json.dumps(rec, indent=1))
    keep = {k: rec.get(k) for k in ("training", "lossless", "tau", "times_s")}
    return {"status": _status_of(rc, bool(rec.get("lossless")), "not lossless"), **keep}


def step_ncu(check: GpuCheck, step: Step) -> dict:
    ncu = find_tool("ncu")
    if not ncu:
        return {"status": "skipped: no ncu"}
    if not find_tool("nvcc"):
        return {"status": "skipped: no nvcc (the kernel library is built by nvcc)"}
    deadline = _step_deadline(step, time.monotonic(), check)
    lib, build = _build_kernel_lib(check, deadline)
    if lib is None:
        return {"status": "timeout" if build["rc"] is None else "fail: nvcc could not build the kernel library"}
    csv_path = check.logs / "ncu.csv"
    rc, s = check.run([ncu, "--target-processes", "all", "--csv", "--metrics", ",".join(NCU_METRICS),
                       "--log-file", csv_path, check.python, "bench/gpu_kernel_driver.py", "--lib", lib,
                       "--cases", "profile", "--dtypes", "float32,bfloat16"],
                      check.log_path("ncu.log"), deadline - time.monotonic())
    text = "\n".join(p.read_text(errors="replace") for p in (csv_path, check.log_path("ncu.log")) if p.is_file())
    if "ERR_NVGPUCTRPERM" in text:
        return {"status": "skipped: no permission for the GPU performance counters (ERR_NVGPUCTRPERM)"}
    kernels = parse_ncu_csv(text)
    return {"status": _status_of(rc, bool(kernels), "no kernel profiled (see logs/ncu.log)"), "kernels": kernels}


def parse_ncu_csv(text: str) -> dict:
    """{"kernel (launch id)": {metric: value}} from ncu --csv output (other lines ignored)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    out: dict = {}
    if not lines:
        return out
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        name, metric, value = row.get("Kernel Name"), row.get("Metric Name"), row.get("Metric Value")
        if not (name and metric) or name == "Kernel Name":
            continue
        key = f"{name.split('(')[0].strip()} #{row.get('ID', '?')}"
        unit = row.get("Metric Unit") or ""
        out.setdefault(key, {})[metric + (f" [{unit}]" if unit else "")] = value
    return out


STEPS = [
    Step("probe", 30, "versions, the GPU and its limits, the CUDA tools", step_probe, needs_cuda=False),
    Step("build_ext", 300, "the extension with the CUDA ops, in the background (python -m sglang_dlite.ops.build)",
         step_build_ext),
    Step("sanitizer", 150, "the standalone kernel library under compute-sanitizer memcheck/racecheck/synccheck, "
         "small shapes vs the reference", step_sanitizer),
    Step("op_tests", 150, "python_tests/ops/test_ops_cuda.py: the CUDA ops vs the reference", step_op_tests),
    Step("cuda_graphs", 60, "the drafter's CUDA graphs bitwise == eager at every bucket size", step_cuda_graphs),
    Step("draft_latency", 120, "batch 1/8/32 x context 512/32k: torch vs CUDA ops vs CUDA graphs, draft round / "
         "verify forward", step_draft_latency),
    Step("engine", 60, "the reference engine on CUDA, float32, CUDA ops: greedy output == the target's", step_engine),
    Step("train", 120, "a 100-step training smoke on CUDA (gen-data and the lossless check on CUDA too)", step_train),
    Step("ncu", 60, "Nsight Compute metrics per kernel (if time is left)", step_ncu),
]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "artifacts/gpu_check",
                    help="folder for summary.json, draft_latency.json, logs.tar.gz (default $OUT)")
    ap.add_argument("--work", default=None, help="logs and build outputs (default: a new temporary folder)")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds from the start (default 500)")
    ap.add_argument("--steps", default=None, help="comma list: run only these steps (probe always runs)")
    ap.add_argument("--skip", default="", help="comma list of steps not to run")
    ap.add_argument("--budget", action="append", default=[], metavar="STEP=S", help="override a step's budget")
    ap.add_argument("--no-cuda", action="store_true", help="treat the machine as one without CUDA (the dry run)")
    ap.add_argument("--list", action="store_true", help="print the step table and exit")
    args = ap.parse_args(argv)
    names = [s.name for s in STEPS]
    if args.list:
        for s in STEPS:
            print(f"{s.name:14s} {s.budget_s:5.0f} s  {'CUDA ' if s.needs_cuda else 'any  '} {s.what}")
        print(f"deadline {DEADLINE_S:.0f} s")
        return 0
    want = set(names) if args.steps is None else {x.strip() for x in args.steps.split(",") if x.strip()} | {"probe"}
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    budgets = {}
    for b in args.budget:
        k, _, v = b.partition("=")
        budgets[k.strip()] = float(v)
    unknown = sorted((want | skip | set(budgets)) - set(names))
    if unknown:
        ap.error(f"unknown step(s) {unknown}; steps: {', '.join(names)}")
    if "op_tests" in want and "build_ext" not in skip:
        want.add("build_ext")
    steps = [Step(s.name, budgets.get(s.name, s.budget_s), s.what, s.fn, s.needs_cuda)
             for s in STEPS if s.name in want and s.name not in skip]
    work = args.work or tempfile.mkdtemp(prefix="gpu_check_")
    check = GpuCheck(args.out, work, steps, args.deadline, args.no_cuda, argv=argv)

    def on_signal(signum, frame):
        check.say(f"signal {signum}: writing the summary and stopping")
        check.interrupted(signum)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return check.run_all()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
