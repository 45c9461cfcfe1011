"""`sglang-dlite train-default` (`make train-default`): the shipped drafter's whole recipe.

    1. gen-data   DEFAULT_GEN (reuses finished shards in --data)
    2. features   captured during gen-data (computed by `train` for any shard that lacks them)
    3. train      teacher -> distill -> stabilize with DEFAULT_TRAIN (bf16 autocast on a GPU, float32 on a CPU)
    4. export     the stabilized DLite drafter in bf16 safetensors + a model card

Sized for a 2-core, 24 GiB machine: the stage budgets (``--stage-budget-min``) cap every stage's
wall time, the cosine schedule is compressed to what fits, and everything is resumable (rerun
the same command after an interruption: finished shards and stages are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Optional

import torch

from sglang_dlite.model.config import low_mid_high_layer_ids, target_info
from sglang_dlite.model.dlite import SHIPPED_DRAFTER_DIR
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.model.bundled_target import resolve_target
from dlite_lab.training import draft_vocab as dv
from dlite_lab.training import gen_data, train
from dlite_lab.training.model_card import read_drafter_config, render_card
from dlite_lab.training.run_summary import read_training_json, summarize

DEFAULT_DATA = os.path.join("artifacts", "train", "data")
DEFAULT_OUT = os.path.join("artifacts", "train", "default")
DEFAULT_GEN = dict(
    prompts=["sharegpt:480", "bfcl:192", "stdlib:192"], shard_size=12, max_new_tokens=192, max_turns=2,
    max_user_tokens=640, max_len=1536, temperature=0.0, top_p=1.0, seed=0,
)
DEFAULT_GEN_BUDGET_MIN = 75.0  # with the 55-minute training budget: <= 3 h on 2 cores, features included
# the trainer's options that differ from `sglang-dlite train`'s defaults (which give the rest, bf16
# autocast included: on a GPU only, as on a CPU without bf16 instructions it is emulated, 3.4x slower)
DEFAULT_TRAIN = dict(
    # step counts are upper bounds: the stage budgets (--stage-budget-min) end each stage
    steps_teacher=20000, steps_distill=20000, steps_stabilize=40000, lr=1.5e-3, batch_size=32, seqs_per_batch=2,
    vocab_subset=8192, eval_every=40, save_every=10,
    # every position is a training anchor (prompt text too): ~3.3x the anchors of the same data
    anchor_tokens="all",
    # EAGLE-3's low/mid/high choice beat the method's proportional 10,12 on held-out tau (model card)
    target_layer_ids="2,15,27",
)

# drafting vocabulary of the export: as many most frequent tokens as the training losses cover
DEFAULT_DRAFT_VOCAB = DEFAULT_TRAIN["vocab_subset"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default",
                   help="HF checkpoint folder of a supported architecture (Llama, Mistral, Qwen2, Qwen3) or "
                        "'default' (the bundled SmolLM2-135M-Instruct); the drafter is sized from it")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--export", default=None,
                   help="export folder (default: OUT/dlite-smollm2-135m for the bundled target, else OUT/dlite-<target folder>)")
    p.add_argument("--install", action="store_true",
                   help="also copy the exported drafter into the package (the shipped default checkpoint)")
    p.add_argument("--gen-max-shards", type=int, default=None, help="generate at most this many new shards")
    p.add_argument("--skip-gen", action="store_true", help="train on the shards already in --data")
    p.add_argument("--gen-budget-min", type=float, default=DEFAULT_GEN_BUDGET_MIN,
                   help="gen-data starts no new shard after this many minutes (resumable: rerun to add more)")
    p.add_argument("--stage-budget-min", default="15,15,25",
                   help="wall-time caps (minutes) of the teacher, distill and stabilize stages")
    p.add_argument("--threads", type=int, default=2, help="torch threads per training process")
    p.add_argument("--device", default="auto", help="training device: auto (CUDA when available) | cuda | cpu "
                   "(several GPUs: gen-data, then `torchrun --nproc-per-node N -m sglang_dlite train ...`)")
    p.add_argument("--single-stage", action="store_true", help="the single-stage ablation instead")
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                   help="export with a drafting vocabulary of the data's N most frequent tokens (0: none; "
                        "see training/draft_vocab.py)")
    p.add_argument("--no-progress", action="store_true")


def layer_ids_for(target_path: str) -> str:
    """The recipe's captured layers for a target: EAGLE-3's low / mid / high choice
    (``config.low_mid_high_layer_ids``; 2,15,27 for the bundled 30-layer target)."""
    return ",".join(map(str, low_mid_high_layer_ids(target_info(target_path).num_layers)))


def export_name(target_path: str, is_default: bool) -> str:
    if is_default:
        return "dlite-smollm2-135m"
    return "dlite-" + os.path.basename(os.path.normpath(target_path)).lower()


def gen_args(args):
    """gen-data's namespace for the recipe: DEFAULT_GEN and the recipe's own options."""
    return argparse.Namespace(**dict(DEFAULT_GEN, prompts=list(DEFAULT_GEN["prompts"])), target=args.target, out=args.data,
                              worker="0/1", reverse=False, threads=max(2, args.threads), max_shards=args.gen_max_shards,
                              capture_layers=getattr(args, "layer_ids", None) or DEFAULT_TRAIN["target_layer_ids"],
                              no_features=False, budget_min=args.gen_budget_min)


def train_args(args, out):
    """`sglang-dlite train`'s namespace for the recipe: the trainer's CLI defaults, DEFAULT_TRAIN over them."""
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    ns = p.parse_args(["--data", args.data, "--out", out])
    vars(ns).update(DEFAULT_TRAIN, target=args.target, single_stage=args.single_stage, resume=True, threads=args.threads,
                    target_layer_ids=getattr(args, "layer_ids", None) or DEFAULT_TRAIN["target_layer_ids"],
                    stage_budget_min=args.stage_budget_min, no_progress=args.no_progress, engine_eval_convs=1,
                    engine_eval_stages="stabilize", device=args.device)
    return ns


def export(model_dir: str, dest: str, card: str, data_dir: Optional[str] = None, draft_vocab: int = 0) -> str:
    """The drafter in bf16 safetensors + its model card; with ``draft_vocab`` N > 0, a drafting
    vocabulary of the N most frequent tokens of ``data_dir`` (training/draft_vocab.py)."""
    m = DLiteDrafter.from_pretrained(model_dir)
    if draft_vocab:
        card = dv.with_card_line(card, dv.apply(m, data_dir, draft_vocab))
    tmp = dest.rstrip("/") + ".partial"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    m.save_pretrained(tmp, dtype=torch.bfloat16)
    if os.path.isfile(os.path.join(model_dir, "training.json")):  # the run's data/steps/tau record (train.py)
        shutil.copy(os.path.join(model_dir, "training.json"), os.path.join(tmp, "training.json"))
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(card)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def run(args) -> int:
    is_default = args.target in (None, "", "default")
    target_path = resolve_target(args.target)  # refuses unsupported architectures
    args.layer_ids = layer_ids_for(target_path)
    t0 = time.time()
    if not args.skip_gen:
        gen_data.run(gen_args(args))
    t1 = time.time()
    out = args.out if not args.single_stage else args.out + "-single-stage"
    train.run(train_args(args, out))
    t2 = time.time()
    final = os.path.join(out, "stabilize", "model")
    summary = summarize(out, args.data)
    name = export_name(target_path, is_default)
    summary.update(wall_s={"gen_data_this_run": round(t1 - t0, 1), "train_this_run": round(t2 - t1, 1)},
                   training=read_training_json(final), target_name=os.path.basename(os.path.normpath(target_path)),
                   export_name=name, drafter_config=read_drafter_config(final))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    dest = args.export or os.path.join(out, name)
    card = render_card(summary)
    export(final, dest, card, args.data, args.draft_vocab)
    print(f"train-default: exported {dest} ({os.path.getsize(os.path.join(dest, 'model.safetensors')) / 1e6:.1f} MB)")
    if args.install:
        if not is_default:
            print("train-default: --install is for the bundled target's shipped drafter; not installing a drafter "
                  f"for {target_path}")
            return 0
        export(final, SHIPPED_DRAFTER_DIR, card, args.data, args.draft_vocab)
        print(f"train-default: installed as the shipped default drafter in {SHIPPED_DRAFTER_DIR}")
    return 0
