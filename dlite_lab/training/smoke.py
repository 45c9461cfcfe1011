"""``make train-smoke``: the whole train-a-drafter pipeline on a tiny random target, in minutes.

    1. target      a tiny random-weight target with a tokenizer (training/tiny_target.py)
    2. gen-data    the target regenerates answers to a few prompts (features captured)
    3. train       2 training processes (torchrun)
    4. export      bf16 safetensors + model card (training/recipe.export)
    5. reference   the exported drafter in the reference engine: greedy output == the target's own

Prints the wall time of every step and writes OUT/smoke.json. ``--arch qwen3`` (or mistral,
qwen2) runs the same on another architecture. The pieces (``write_prompts``, ``check_lossless``)
are what python_tests/model/test_any_target.py runs too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_dlite.cli import main as cli
from dlite_lab.reference.drafters import DLiteEngineDrafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.tau import tau_of_requests
from dlite_lab.training.checkpoint import read_metrics
from dlite_lab.training.recipe import export
from dlite_lab.training.tiny_target import save_tiny_target

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "What does `os.path.join` do? Give an example.",
    "Summarize what a hash map is in two sentences.",
    "Write a shell command that counts the lines of every .py file in a folder.",
    "List three ways to speed up a slow SQL query.",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) + 1",
    "Describe how speculative decoding keeps the output of the target model unchanged.",
]


def write_prompts(path: str, n: int = 8) -> str:
    """A jsonl prompt file (``--prompts jsonl:PATH``) with ``n`` single-turn chats."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}]}) + "\n")
    return path


def gen_data_argv(target: str, prompts: str, out: str, max_new_tokens: int = 24, shard_size: int = 4,
                  device: str = None) -> list:
    """``device``: gen-data's --device (the hf engine's target device; default: the CPU)."""
    return ["gen-data", "--target", target, "--prompts", f"jsonl:{prompts}", "--out", out, "--engine", "hf",
            "--shard-size", str(shard_size), "--max-new-tokens", str(max_new_tokens), "--max-turns", "1",
            "--max-user-tokens", "128", "--max-len", "512", "--threads", "1", "--min-free-gb", "0"] + (
        ["--device", device] if device else [])


def train_argv(target: str, data: str, out: str, steps: int = 40, device: str = None) -> list:
    """A short single-stage run; batch sizes are per process. ``device``: the trainer's --device."""
    return ["train", "--target", target, "--data", data, "--out", out, "--single-stage",
            "--steps-stabilize", str(steps), "--batch-size", "16", "--seqs-per-batch", "2", "--lr", "3e-3",
            "--eval-every", str(steps), "--eval-anchors", "64", "--save-every", str(steps), "--threads", "1",
            "--no-progress"] + (["--device", device] if device else [])


def training_throughput(run_dir: str, stage: str = "stabilize") -> dict:
    """Steps/s (steps over the stage's training wall time, evaluations excluded) and anchors/s (the
    median of the logged intervals after the first, which holds the warm-up) of a finished stage."""
    with open(os.path.join(run_dir, stage, "DONE.json")) as f:
        done = json.load(f)
    rates = [r["anchors_per_s"] for r in read_metrics(run_dir) if r.get("stage") == stage and "anchors_per_s" in r]
    steady = rates[1:] or rates
    return {"steps": done.get("steps"), "train_wall_s": done.get("wall_s"), "device": done.get("device", "cpu"),
            "steps_per_s": round(done["steps"] / max(done.get("wall_s") or 0, 1e-9), 2),
            "anchors_per_s": round(statistics.median(steady), 1) if steady else None}


def train_command(argv: list, procs: int, launcher: str = "torchrun") -> list:
    """The training command: one process, or ``procs`` under torchrun (the trainer's only launcher;
    its former ``--ddp N`` is refused)."""
    if launcher != "torchrun":
        raise ValueError(f"launcher {launcher!r}: training runs under torchrun only.")
    if procs <= 1:
        return [sys.executable, "-m", "sglang_dlite", *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
            "-m", "sglang_dlite", *argv]


def target_greedy(target, prompts: list, max_new_tokens: int) -> list:
    """The target's own greedy continuation of each prompt (HF generate, fp32, batch 1)."""
    outs = []
    dev = next(target.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def chat_prompts(tok, n: int = 2) -> list:
    return [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]) for m in PROMPTS[:n]]


def check_lossless(target_path: str, drafter_path: str, n_prompts: int = 2, max_new_tokens: int = 32,
                   device: str = None) -> dict:
    """Reference engine with the drafter vs the target's own greedy decoding, on chat prompts:
    {"identical": bool, "tau": float, "outputs": [...], "target": [...]}. ``device``: where the
    target, the drafter and the engine run (default: the CPU)."""
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype="float32").eval()
    if device:
        target.to(device)
    tok = AutoTokenizer.from_pretrained(target_path)
    prompts = chat_prompts(tok, n_prompts)
    drafter = DLiteDrafter.from_pretrained(drafter_path).float().bind_hf_target(target)
    eng = ReferenceEngine(target, DLiteEngineDrafter(drafter))
    res = [eng.generate(list(p), max_new_tokens) for p in prompts]
    want = target_greedy(target, prompts, max_new_tokens)
    got = [r.output_ids for r in res]
    t = tau_of_requests((len(r.output_ids), len(r.rounds)) for r in res)  # drafting/tau.py: the prefill's token excluded
    return {"identical": got == want, "tau": float("nan") if t is None else t, "outputs": got,
            "target": want, "prompts": prompts}


def run(args) -> int:
    out = args.out
    if os.path.isdir(out) and not args.keep:
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    times = {}
    launcher = "torchrun"

    def step(name, fn):
        t = time.time()
        print(f"train-smoke: {name} ...", flush=True)
        r = fn()
        times[name] = round(time.time() - t, 1)
        print(f"train-smoke: {name} done in {times[name]:.1f} s", flush=True)
        return r

    target = os.path.join(out, f"target-{args.arch}")
    data, run_dir, dest = os.path.join(out, "data"), os.path.join(out, "run"), os.path.join(out, "drafter")
    step("target", lambda: save_tiny_target(target, args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers,
                                            heads=max(4, args.hidden // 64), kv_heads=max(2, args.hidden // 256)))
    prompts = write_prompts(os.path.join(out, "prompts.jsonl"), args.prompts)

    def gen():
        rc = cli(gen_data_argv(target, prompts, data, args.max_new_tokens, device=args.device))
        if rc:
            raise SystemExit(f"train-smoke: gen-data failed (exit {rc})")

    step("gen-data", gen)
    cmd = train_command(train_argv(target, data, run_dir, args.steps, args.device), args.procs, launcher)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def train():
        print("  " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)

    step(f"train ({args.procs} processes, {launcher if args.procs > 1 else 'single'})", train)
    model_dir = os.path.join(run_dir, "stabilize", "model")
    step("export", lambda: export(model_dir, dest, f"# Smoke-test DLite drafter for a tiny random {args.arch} target\n"))
    check = step("reference engine", lambda: check_lossless(target, dest, max_new_tokens=args.max_new_tokens,
                                                            device=args.device))
    total = round(sum(times.values()), 1)
    rec = {"arch": args.arch, "hidden": args.hidden, "layers": args.layers, "launcher": launcher,
           "processes": args.procs, "steps": args.steps, "times_s": times, "total_s": total,
           "training": training_throughput(run_dir), "lossless": check["identical"], "tau": round(check["tau"], 3),
           "torch_threads_per_process": 1, "drafter": dest}
    with open(os.path.join(out, "smoke.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print("\n| step | wall (s) |\n|---|---|")
    for k, v in times.items():
        print(f"| {k} | {v:.1f} |")
    print(f"| **total** | **{total:.1f}** |")
    tr = rec["training"]
    print(f"\ntraining on {tr['device']}: {tr['steps']} steps in {tr['train_wall_s']} s = {tr['steps_per_s']} steps/s, "
          f"{tr['anchors_per_s']} anchors/s")
    print(f"\ntrain-smoke: {args.arch} target, reference engine greedy == target greedy: {check['identical']}, "
          f"tau {check['tau']:.2f}; {os.path.join(out, 'smoke.json')}")
    if not check["identical"]:
        print("train-smoke: FAILED: the reference engine's output differs from the target's greedy output", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("artifacts", "train-smoke"))
    ap.add_argument("--arch", default="llama", help="llama | qwen3 | qwen2 | mistral")
    ap.add_argument("--procs", type=int, default=2, help="training processes")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64, help="tiny target's hidden size (heads: hidden/64, >= 4)")
    ap.add_argument("--layers", type=int, default=6, help="tiny target's decoder layers")
    ap.add_argument("--device", default=None,
                    help="where gen-data (hf engine), training and the reference-engine check run (cuda | cpu; "
                         "default: gen-data and the check on the CPU, training on the trainer's default)")
    ap.add_argument("--keep", action="store_true", help="keep OUT from an earlier run (resume)")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
