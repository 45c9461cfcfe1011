"""bench/gpu_check.sh (the one command for a lent GPU machine) and the GPU paths that need no sglang.

- The dry run on a machine without CUDA: every GPU step "skipped: no CUDA", summary.json valid,
  only the three files in --out, exit 0, well under 60 s.
- The budget logic: a step whose budget exceeds the time left is skipped (later, cheaper steps
  still run), summary.json is rewritten at every step, a step over its budget is killed.
- The pieces a GPU runs, checked here on the CPU: the kernel driver's launcher calls (argument
  order, sizes, dtype codes) against a stand-in library, the reference engine on an explicit
  device with every tensor it makes on the target's device, the drafter CUDA graphs and the engine
  check importing no sglang, gen-data's --device.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def bench_module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc():
    return bench_module("gpu_check")


# ------------------------------------------------------------------------------ the dry run
def test_dry_run_skips_every_gpu_step_and_passes(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    extra = ["--no-cuda"] if torch.cuda.is_available() else []
    env = dict(os.environ, OUT=str(out))
    t = time.time()
    p = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--work", str(work), *extra],
                       capture_output=True, text=True, env=env, timeout=120)
    wall = time.time() - t
    assert p.returncode == 0, p.stdout + p.stderr
    assert wall <= 60, wall
    assert set(os.listdir(out)) <= {"summary.json", "draft_latency.json", "logs.tar.gz"}
    s = json.loads((out / "summary.json").read_text())
    assert s["finished"] and s["ok"] and not s["cuda"]
    steps = {r["name"]: r for r in s["steps"]}
    assert list(steps)[:4] == ["probe", "build_ext", "sanitizer", "op_tests"]
    assert steps["probe"]["status"] == "ok" and steps["probe"]["versions"]["torch"]
    gpu_steps = [n for n in steps if n != "probe"]
    assert {"sanitizer", "op_tests", "cuda_graphs", "draft_latency", "engine", "train", "ncu"} <= set(gpu_steps)
    for n in gpu_steps:
        assert steps[n]["status"].startswith("skipped: no CUDA"), (n, steps[n]["status"])
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/probe.log" in names and "logs/probe.json" in names


def test_step_table_lists_the_steps_in_order_of_value(gc):
    names = [s.name for s in gc.STEPS]
    assert names == ["probe", "build_ext", "sanitizer", "op_tests", "cuda_graphs", "draft_latency", "engine",
                     "train", "ncu"]
    assert [s.name for s in gc.STEPS if not s.needs_cuda] == ["probe"]
    assert gc.DEADLINE_S == 500
    # steps that run one after the other fit the 540 s target when each takes its expected time,
    # and no single step's budget can starve the rest
    assert all(s.budget_s <= 300 for s in gc.STEPS)


# ------------------------------------------------------------------------------ the budget logic
def steps_for_budget_test(gc, out):
    seen = {}

    def first(check, step):
        time.sleep(0.2)
        return {"status": "ok", "value": 1}

    def reader(check, step):  # the summary on disk at this step's start
        seen[step.name] = json.loads((out / "summary.json").read_text())
        return {"status": "ok"}

    def never(check, step):
        raise AssertionError("a skipped step ran")

    def broken(check, step):
        raise RuntimeError("bug in a step")

    steps = [gc.Step("a", 5, "first", first, needs_cuda=False),
             gc.Step("b", 5, "reads the summary", reader, needs_cuda=False),
             gc.Step("big", 60, "over the time left", never, needs_cuda=False),
             gc.Step("c", 5, "cheaper, after the skipped one", reader, needs_cuda=False),
             gc.Step("gpu", 1, "needs CUDA", never),
             gc.Step("d", 5, "raises", broken, needs_cuda=False),
             gc.Step("e", 5, "after the broken one", reader, needs_cuda=False)]
    return steps, seen


def test_a_step_over_the_time_left_is_skipped_and_the_summary_follows_every_step(gc, tmp_path):
    out = tmp_path / "out"
    steps, seen = steps_for_budget_test(gc, out)
    check = gc.GpuCheck(str(out), str(tmp_path / "work"), steps, deadline_s=30)
    rc = check.run_all()
    s = json.loads((out / "summary.json").read_text())
    st = {r["name"]: r for r in s["steps"]}
    # rewritten after every step: b saw a finished (with its result), itself running, the rest pending
    at_b = {r["name"]: r for r in seen["b"]["steps"]}
    assert at_b["a"]["status"] == "ok" and at_b["a"]["value"] == 1 and at_b["a"]["seconds"] >= 0.2
    assert at_b["b"]["status"] == "running" and at_b["big"]["status"] == "pending"
    assert not seen["b"]["finished"]
    at_c = {r["name"]: r for r in seen["c"]["steps"]}
    assert at_c["big"]["status"].startswith("skipped: budget 60 s >")
    assert st["big"]["status"].startswith("skipped: budget 60 s > ") and st["big"]["status"].endswith(" s left")
    assert st["c"]["status"] == "ok"  # a cheaper step after a skipped one still runs
    assert st["gpu"]["status"] == "skipped: no CUDA"
    assert st["d"]["status"] == "fail: RuntimeError: bug in a step" and st["e"]["status"] == "ok"
    assert rc == 1 and not s["ok"] and s["finished"] and s["counts"]["fail"] == 1
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.json"]


def test_steps_past_the_deadline_are_skipped(gc, tmp_path):
    ran = []

    def slow(check, step):
        time.sleep(1.2)
        ran.append(step.name)
        return {"status": "ok"}

    steps = [gc.Step("slow", 1, "", slow, needs_cuda=False), gc.Step("next", 1, "", slow, needs_cuda=False)]
    check = gc.GpuCheck(str(tmp_path / "out"), str(tmp_path / "w"), steps, deadline_s=2.0)
    assert check.run_all() == 0  # skipped is not failed
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert ran == ["slow"] and s["steps"][1]["status"] == "skipped: budget 1 s > 1 s left"
    assert s["ok"] and not s["all_steps_ok"]


def test_a_command_over_its_budget_is_killed_with_its_children(gc, tmp_path):
    def sleeper(check, step):
        # a child that starts a grandchild: the whole process group goes
        rc, s = check.run([sys.executable, "-c", "import subprocess, sys, time; "
                           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                          check.log_path("sleeper.log"), timeout=1.0)
        return {"status": "timeout" if rc is None else "ok", "seconds_run": s}

    check = gc.GpuCheck(str(tmp_path / "out"), str(tmp_path / "w"), [gc.Step("s", 10, "", sleeper, needs_cuda=False)])
    t = time.time()
    assert check.run_all() == 1
    assert time.time() - t < 15
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["steps"][0]["status"] == "timeout"
    assert "[exit timeout" in (tmp_path / "w" / "logs" / "sleeper.log").read_text()


def test_step_selection_and_budget_overrides(gc, tmp_path):
    out = tmp_path / "out"
    rc = gc.main(["--out", str(out), "--work", str(tmp_path / "w"), "--steps", "engine", "--no-cuda",
                  "--budget", "engine=7"])
    s = json.loads((out / "summary.json").read_text())
    assert rc == 0 and [r["name"] for r in s["steps"]] == ["probe", "engine"]
    assert s["steps"][1]["budget_s"] == 7 and s["steps"][1]["status"] == "skipped: no CUDA (--no-cuda)"
    with pytest.raises(SystemExit):
        gc.main(["--out", str(out), "--steps", "nonsense"])


def test_ncu_csv_is_read_per_kernel(gc):
    text = ('==PROF== Connected to process 1\n'
            '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","1","python3","127.0.0.1","void assemble_kernel<float>(const float *)","1","7","(128, 1, 1)",'
            '"(480, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","3.10"\n'
            '"0","1","python3","127.0.0.1","void assemble_kernel<float>(const float *)","1","7","(128, 1, 1)",'
            '"(480, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
            '"%","12.5"\n')
    k = gc.parse_ncu_csv(text)
    assert k == {"void assemble_kernel<float> #0": {"gpu__time_duration.sum [us]": "3.10",
                                                    "sm__throughput.avg.pct_of_peak_sustained_elapsed [%]": "12.5"}}
    assert gc.parse_ncu_csv("no csv here") == {}


# ------------------------------------------------------------------------------ the kernel driver
class FakeKernelLib:
    """The plain C launchers of csrc/cuda/dlite_cuda.h as the reference ops on CPU tensors found by
    their data pointers: checks the driver's argument order, sizes and dtype codes."""

    def __init__(self, tensors: dict):
        from sglang_dlite.ops import reference as R

        self.R, self.t = R, tensors
        self.calls = []

    def get(self, p, shape, dtype):
        if p.value is None:
            return torch.empty(shape, dtype=dtype)
        t = self.t[p.value]
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (t.shape, shape, t.dtype, dtype)
        return t

    def dtype(self, code):
        return {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}[code]

    def dlite_assemble_round_inputs_cuda(self, dt, ctx, anchor, nw, depth, mask, out, B, L, C, H, K, eps, stream):
        T = self.dtype(dt)
        args = (self.get(ctx, (B, L, C, H), T), self.get(anchor, (B, H), T), self.get(nw, (L, H), T),
                self.get(depth, (L + 1, H), T), self.get(mask, (H,), T))
        self.get(out, (B, L * C + 1 + K, H), T).copy_(self.R.assemble_round_inputs(*args, K, eps))
        self.calls.append("assemble")
        return 0

    def dlite_round_attention_cuda(self, dt, q, k, v, cos, sin, valid, out, B, S, Hq, Hkv, D, L, C, causal, stream):
        T = self.dtype(dt)
        K = S - L * C - 1
        qq, kk, vv = self.get(q, (B, S, Hq, D), T), self.get(k, (B, S, Hkv, D), T), self.get(v, (B, S, Hkv, D), T)
        cs, sn = self.get(cos, (S, D), torch.float32), self.get(sin, (S, D), torch.float32)
        ok = self.get(valid, (B, C), torch.bool)
        res = self.R.round_attention(qq, kk, vv, cs.to(T), sn.to(T), ok, L, K, bool(causal))
        self.get(out, (B, S, Hq, D), T).copy_(res)
        self.calls.append("attention")
        return 0

    def dlite_lowrank_rnn_scan_cuda(self, dt, g, u, out, B, K, R, stream):
        T = self.dtype(dt)
        res = self.R.lowrank_rnn_scan(self.get(g, (B, K, R), T), self.get(u, (B, K, R), T))
        self.get(out, (B, K, R), T).copy_(res)
        self.calls.append("scan")
        return 0

    def dlite_rowwise_argmax_cuda(self, dt, logits, out, M, V, stream):
        x = self.get(logits, (M, V), self.dtype(dt))
        self.get(out, (M,), torch.int64).copy_(x.float().argmax(-1))
        self.calls.append("argmax")
        return 0


def test_kernel_driver_calls_every_launcher_as_the_header_declares(monkeypatch):
    drv = bench_module("gpu_kernel_driver")
    tensors = {}

    def on_device(t):  # the CPU stands in for the GPU: same bytes, found again by pointer
        t = t.contiguous().clone()
        if t.data_ptr():
            tensors[t.data_ptr()] = t
        return t

    monkeypatch.setattr(drv, "dev", on_device)
    monkeypatch.setattr(drv, "stream", lambda: ctypes.c_void_p(None))
    lib = FakeKernelLib(tensors)
    runners = {"assemble_round_inputs": drv.run_assemble, "lowrank_rnn_scan": drv.run_scan,
               "rowwise_argmax": drv.run_argmax}
    gen = torch.Generator().manual_seed(0)
    n = 0
    for op, shape, dt, causal in drv.cases("small", [torch.float32, torch.bfloat16, torch.float16]):
        if op == "round_attention":
            rc, out, want = drv.run_attention(lib, shape, dt, gen, causal)
        else:
            rc, out, want = runners[op](lib, shape, dt, gen)
        ok, err = drv.compare(out, want, dt)
        assert rc == 0 and ok, (op, shape, dt, causal, err)
        n += 1
    assert n == len(lib.calls) and set(lib.calls) == {"assemble", "attention", "scan", "argmax"}
    # an output the kernel does not write stays NaN / -1 and fails the comparison
    assert not drv.compare(drv.blank((2, 3), torch.float32), torch.zeros(2, 3), torch.float32)[0]
    assert not drv.compare(drv.blank((2,), torch.int64), torch.zeros(2, dtype=torch.int64), torch.float32)[0]


# ------------------------------------------------------------------------------ no sglang on the GPU paths
def run_without_sglang(code: str, timeout=180):
    """Python with ``import sglang`` failing (as on the lent GPU machine)."""
    pre = "import sys; sys.modules['sglang'] = None\n"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


def test_drafter_cuda_graphs_import_without_sglang():
    p = run_without_sglang("from sglang_dlite.serving.cuda_graphs import DrafterCudaGraphs\n"
                           "import sglang_dlite.serving\n"
                           "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules if sys.modules[m])\n"
                           "print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_engine_check_runs_on_the_cpu_without_sglang(tmp_path):
    """The device step's code path (bench/gpu_steps.py engine) on the CPU: lossless, devices agree."""
    out = tmp_path / "engine.json"
    p = run_without_sglang("import runpy\n"
                           f"sys.argv = ['gpu_steps.py', 'engine', '--device', 'cpu', '--prompts', '3', "
                           f"'--max-new-tokens', '24', '--out', {str(out)!r}]\n"
                           "try:\n    runpy.run_path('bench/gpu_steps.py', run_name='__main__')\n"
                           "except SystemExit as e:\n    sys.exit(e.code)")
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads(out.read_text())
    assert rec["ok"] and rec["dlite_identical"] and rec["oracle_identical"] and rec["no_spec_identical"]
    assert rec["device"] == rec["target_device"] == rec["drafter_device"] == rec["hidden_device"] == "cpu"
    assert rec["oracle_tau"] > 2


# ------------------------------------------------------------------------------ the engine's device
class TorchSpy:
    """Stands in for ``torch`` inside dlite_lab.reference.engine: records the device of every tensor and
    generator the engine itself creates."""

    def __init__(self):
        self.made = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def tensor(self, *a, **kw):
        self.made.append(("tensor", kw.get("device")))
        return torch.tensor(*a, **kw)

    def Generator(self, *a, **kw):
        self.made.append(("Generator", kw.get("device")))
        return torch.Generator(*a, **kw)


def tiny_engine_parts():
    from dlite_lab.benchmarking.random_models import tiny_llama
    from sglang_dlite.model.config import DLiteConfig
    from dlite_lab.reference.drafters import DLiteEngineDrafter
    from sglang_dlite.model.dlite import DLiteDrafter

    target = tiny_llama(seed=0, vocab=96, hidden=64, layers=4, tied=True, max_positions=512)
    for p in target.parameters():
        p.requires_grad_(False)
    c = target.config
    torch.manual_seed(0)
    cfg = DLiteConfig(target_hidden_size=c.hidden_size, vocab_size=c.vocab_size, target_num_layers=c.num_hidden_layers,
                      num_context_positions=3, block_size=4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, rnn_rank=8)
    drafter = DLiteDrafter(cfg).eval().bind_hf_target(target)
    return target, DLiteEngineDrafter(drafter)


def test_engine_makes_every_tensor_on_the_targets_device(monkeypatch):
    from dlite_lab.reference import engine as engine_mod

    target, drafter = tiny_engine_parts()
    moved = []
    real_to = drafter.model.to
    monkeypatch.setattr(drafter.model, "to", lambda *a, **kw: (moved.append((a, kw)), real_to(*a, **kw))[1])
    spy = TorchSpy()
    monkeypatch.setattr(engine_mod, "torch", spy)
    eng = engine_mod.ReferenceEngine(target, drafter, [2], device="cpu")
    assert eng.device == torch.device("cpu") and moved == [((torch.device("cpu"),), {})]  # the drafter follows
    prompt = [1, 5, 9, 14, 20, 33]
    greedy = eng.generate(prompt, 12)
    eng.generate(prompt, 12, temperature=0.9, top_p=0.9, seed=3)  # sampling: a generator on the device
    eng.generate(prompt, 6, speculative=False)
    kinds = {k for k, _ in spy.made}
    assert kinds == {"tensor", "Generator"}
    assert all(d == eng.device for _, d in spy.made), spy.made  # explicit, never the factory default
    monkeypatch.undo()
    # explicit device="cpu" == the default (the target's device), token for token
    target2, drafter2 = tiny_engine_parts()
    assert engine_mod.ReferenceEngine(target2, drafter2, [2]).generate(prompt, 12).output_ids == greedy.output_ids


def test_engine_device_defaults_to_the_targets_and_moves_target_and_drafter(monkeypatch):
    from dlite_lab.reference.engine import ReferenceEngine

    target, drafter = tiny_engine_parts()
    calls = []
    real = target.to
    monkeypatch.setattr(target, "to", lambda *a, **kw: (calls.append(a), real(*a, **kw))[1])
    eng = ReferenceEngine(target, drafter, [2])
    assert eng.device == next(target.parameters()).device and calls == []  # no device: nothing moved
    ReferenceEngine(target, drafter, [2], device="cpu").close()
    assert calls == [("cpu",)]
    assert eng.generate([1, 4, 7], 5).output_ids  # hidden states captured where the target runs
    sess = eng.new_session()
    eng.generate([1, 4, 7], 3, session=sess)
    assert sess.hidden.device == eng.device


# ------------------------------------------------------------------------------ gen-data --device
def test_gen_data_device_is_checked_before_anything_runs(monkeypatch):
    from argparse import Namespace

    from sglang_dlite.errors import DLiteConfigError, DLiteInputError
    from dlite_lab.training import gen_data

    assert gen_data._generation_device(Namespace(device="cpu", engine="fast")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DLiteConfigError, match="--device cuda"):
        gen_data._generation_device(Namespace(device="cuda", engine="hf"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gen_data._generation_device(Namespace(device="cuda", engine="hf")) == torch.device("cuda")
    for engine in ("fast", "sglang"):
        with pytest.raises(DLiteInputError, match="only --engine hf"):
            gen_data._generation_device(Namespace(device="cuda", engine=engine))


# ------------------------------------------------------------------------------ every step, with stand-ins
FAKE_PY = r'''
import json, os, subprocess, sys, time
a = sys.argv[1:]
def val(flag):
    for i, x in enumerate(a):
        if x == flag:
            return a[i + 1]
        if x.startswith(flag + "="):
            return x.split("=", 1)[1]
if a[:1] == ["-c"]:
    sys.exit(0)
if a[:2] == ["-m", "sglang_dlite.ops.build"]:
    time.sleep(1)
    sys.exit(0)
if a[:2] == ["-m", "pytest"]:
    with open(val("--junitxml"), "w") as f:
        f.write('<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/></testsuites>')
    sys.exit(0)
if a[:2] == ["-m", "dlite_lab.training.smoke"]:
    os.makedirs(val("--out"), exist_ok=True)
    with open(os.path.join(val("--out"), "smoke.json"), "w") as f:
        json.dump({"lossless": True, "tau": 2.0, "training": {"steps": int(val("--steps")), "device": val("--device")}}, f)
    sys.exit(0)
if a[0].endswith("gpu_steps.py"):
    rec = {"probe": {"ok": True, "cuda_available": True, "gpu": {"capability": "9.0", "name": "stand-in"},
                     "versions": {"transformers": "5", "pytest": "9"}},
           "graphs": {"ok": True, "dtypes": {"float32": {"buckets": [1, 2], "impl": {"round_attention": "cuda"},
                                                         "per_bucket": {"1": {"tokens_equal": True}}}}},
           "engine": {"ok": True, "device": "cuda:0", "dlite_identical": True}}[a[1]]
    rec["argv"] = a
    with open(val("--out"), "w") as f:
        json.dump(rec, f)
    sys.exit(0)
if a[0].endswith("gpu_kernel_driver.py"):
    if val("--json"):
        with open(val("--json"), "w") as f:
            json.dump({"ok": True, "cases": 3, "failed": 0, "argv": a}, f)
    sys.exit(0)
if a[0].endswith("draft_latency.py"):
    with open(val("--out"), "w") as f:
        json.dump({"results": [{"batch": 1, "context": 512, "ms": {"torch": 2.0, "cuda": 1.0, "graph": 0.5},
                                "verify_ms": 4.0, "draft_fraction_of_verify": {"torch": 0.5, "cuda": 0.25, "graph": 0.125}}],
                   "argv": a}, f)
    sys.exit(0)
sys.exit(3)
'''
FAKE_NVCC = r'''
import sys
a = sys.argv[1:]
if "--version" in a:
    print("Cuda compilation tools, release 13.0 (stand-in)")
    sys.exit(0)
open(a[a.index("-o") + 1], "w").write("lib")
'''
FAKE_SANITIZER = r'''
import subprocess, sys
a = sys.argv[1:]
if "--version" in a:
    sys.exit(0)
i = next(i for i, x in enumerate(a) if x.endswith("fakepy"))
rc = subprocess.call(a[i:])
print("========= ERROR SUMMARY: 0 errors")
sys.exit(rc)
'''
FAKE_NCU = r'''
import subprocess, sys
a = sys.argv[1:]
if "--version" in a:
    sys.exit(0)
i = next(i for i, x in enumerate(a) if x.endswith("fakepy"))
with open(a[a.index("--log-file") + 1], "w") as f:
    f.write('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","void scan_warp_kernel<float, 4>(const float *)","gpu__time_duration.sum","us","2.5"\n')
sys.exit(subprocess.call(a[i:]))
'''


def test_every_gpu_step_with_stand_in_tools(gc, tmp_path, monkeypatch):
    """The steps' plumbing as on a GPU machine, with stand-ins for python, nvcc, compute-sanitizer
    and ncu: each step runs its commands, reads their records and ends ok within its budget."""
    fakes = {}
    for name, body in (("fakepy", FAKE_PY), ("nvcc", FAKE_NVCC), ("compute-sanitizer", FAKE_SANITIZER),
                       ("ncu", FAKE_NCU)):
        p = tmp_path / "bin" / name
        p.parent.mkdir(exist_ok=True)
        p.write_text(f"#!{sys.executable}\n{body}")
        p.chmod(0o755)
        fakes[name] = str(p)
    monkeypatch.setattr(gc, "find_tool", lambda name: fakes.get(name))
    out, work = tmp_path / "out", tmp_path / "work"
    check = gc.GpuCheck(str(out), str(work), gc.STEPS, python=fakes["fakepy"])
    assert check.run_all() == 0
    s = json.loads((out / "summary.json").read_text())
    st = {r["name"]: r for r in s["steps"]}
    assert s["all_steps_ok"] and s["cuda"], {n: r["status"] for n, r in st.items()}
    assert st["build_ext"]["rc"] == 0
    assert st["sanitizer"]["nvcc"]["arch"] == "sm_90a"
    assert {k: v["errors"] for k, v in st["sanitizer"]["runs"].items()} == {
        "plain": None, "memcheck": 0, "racecheck": 0, "synccheck": 0}
    assert st["op_tests"]["tests"] == {"tests": 5, "failures": 0, "errors": 0, "skipped": 1}
    assert st["draft_latency"]["impls"] == "torch,cuda,graph" and st["draft_latency"]["rows"][0]["verify_ms"] == 4.0
    assert (out / "draft_latency.json").is_file()
    for name in ("cuda_graphs", "engine"):  # the CUDA ops were built: the steps demand them
        assert "--require-cuda-ops" in json.loads((work / "logs" / f"{name}.json").read_text())["argv"]
    assert st["train"]["training"] == {"steps": 100, "device": "cuda"} and st["train"]["lossless"]
    assert st["ncu"]["kernels"] == {"void scan_warp_kernel<float, 4> #0": {"gpu__time_duration.sum [us]": "2.5"}}
    assert sorted(os.listdir(out)) == ["draft_latency.json", "logs.tar.gz", "summary.json"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/sanitizer_memcheck.log", "logs/build_ext.log", "logs/op_tests.log", "logs/train.log"} <= names
