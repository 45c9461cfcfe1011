"""`sglang-dlite train`'s options, defined once: ``TrainOptions`` holds the defaults, the CLI
(``add_arguments``) reads them from it, ``options_from_args`` maps the CLI back."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from sglang_dlite.model.config import HEAD_INPUTS
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from dlite_lab.training.dataset import ANCHOR_TOKENS

STAGES = ("teacher", "distill", "stabilize")


@dataclass
class Stage:
    name: str
    steps: int
    lr: float
    loss: str  # "ce" | "kl" | "ce+tv"
    history: str  # model history mode


@dataclass
class TrainOptions:
    stages: list = field(default_factory=lambda: list(STAGES))
    steps: dict = field(default_factory=lambda: {"teacher": 300, "distill": 300, "stabilize": 300})
    lr: float = 1e-3
    batch_size: int = 64  # anchors per optimizer step, per process (global: x WORLD_SIZE under torchrun)
    seqs_per_batch: int = 4  # sequences per step, per process
    warmup_frac: float = 0.05
    gamma: float = 4.0
    ce_weight: float = 1.0
    tv_weight: float = 1.0
    kl_weight: float = 0.0  # stabilize: + forward KL to the target's distribution (0: off)
    clip: float = 1.0
    weight_decay: float = 0.01
    ema_decay: float = 0.0  # >0: evaluate and save the exponential moving average of the weights (loop.py)
    bf16: Optional[bool] = None  # bf16 autocast; None: on for CUDA, off on the CPU
    device: str = "auto"  # auto (CUDA when available) | cuda | cpu
    eval_every: int = 100
    eval_anchors: int = 256
    save_every: int = 50
    log_every: int = 10  # metrics.jsonl: mean training loss every N steps
    seed: int = 0
    student_history: str = "none"
    init_layers: Optional[list] = None  # target layer ids the fresh backbones start from (None: random)
    init_drafter: Optional[str] = None  # a trained DLite checkpoint the stabilize stage starts from
    vocab_subset: int = 0  # >0: train over the N most frequent data tokens + batch labels (0: full vocab)
    anchor_tokens: str = "generated"  # train anchors: "generated" spans only, or "all" positions
    distill_init: str = "teacher"
    resume: bool = False
    progress: bool = True
    config_overrides: dict = field(default_factory=dict)
    engine_eval: Optional[callable] = None  # fn(model, stage, step) -> dict of extra metrics
    engine_eval_stages: tuple = STAGES  # stages whose end runs engine_eval
    time_budget_s: Optional[dict] = None  # per stage wall budget: stop early (cosine compressed)
    stream_window: int = 0  # >0: stream the training batches from W shards at a time (stream.py)
    eval_shards: int = 32  # streaming: shards (evenly spaced) whose held-out sequences are evaluated
    shards: Optional[list] = None  # train on these manifest shards only (data.select_shards specs); None: all
    stop_after_s: Optional[float] = None  # pause this process (checkpoint, no re-planning) after this wall time
    stop_after_steps: Optional[int] = None  # pause after this many steps of this process
    started_at: Optional[float] = None  # when this process started training (for stop_after_s)


_D = TrainOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="gen-data output folder")
    p.add_argument("--out", required=True, help="training output folder (checkpoints, metrics, curve.png)")
    p.add_argument("--target", default="default")
    p.add_argument("--device", default=_D.device,
                   help="auto (CUDA when torch sees a GPU, else the CPU) | cuda | cpu. Under torchrun on GPUs each "
                        "process uses GPU LOCAL_RANK")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--single-stage", action="store_true", help="stabilization only, from scratch (ablation)")
    p.add_argument("--history", default=_D.student_history, help="student history: none (DLite) | window:W (ablation)")
    for s in STAGES:
        p.add_argument(f"--steps-{s}", type=int, default=_D.steps[s])
    p.add_argument("--lr", type=float, default=_D.lr)
    p.add_argument("--batch-size", type=int, default=_D.batch_size,
                   help="anchors per optimizer step per process (under torchrun the global batch is "
                        "batch-size x WORLD_SIZE)")
    p.add_argument("--seqs-per-batch", type=int, default=_D.seqs_per_batch, help="sequences per step per process")
    p.add_argument("--gamma", type=float, default=_D.gamma)
    p.add_argument("--ce-weight", type=float, default=_D.ce_weight)
    p.add_argument("--tv-weight", type=float, default=_D.tv_weight)
    p.add_argument("--kl-weight", type=float, default=_D.kl_weight,
                   help="stabilize stage: add forward KL(target || drafter) over the training vocabulary with this "
                        "weight (the target's distribution as the label; --ce-weight 0 --kl-weight 1 trains on KL "
                        "instead of CE)")
    p.add_argument("--clip", type=float, default=_D.clip)
    p.add_argument("--ema-decay", type=float, default=_D.ema_decay,
                   help="keep an exponential moving average of the trained weights (decay d per step, warmed up as "
                        "min(d, (1+t)/(10+t))); evaluations, checkpoints' exports and the saved model use it. "
                        "0 = off. Averaging weights paid off for the shipped drafter (a uniform average of three "
                        "fine-tunes, `sglang-dlite average-drafters`); e.g. 0.999")
    p.add_argument("--warmup-frac", type=float, default=_D.warmup_frac)
    p.add_argument("--bf16", dest="bf16", action="store_const", const=True, default=None,
                   help="bf16 autocast (default: on with --device cuda, off on the CPU; faster on CPUs with bf16)")
    p.add_argument("--no-bf16", dest="bf16", action="store_const", const=False, help="float32 also on a GPU")
    p.add_argument("--vocab-subset", type=int, default=_D.vocab_subset,
                   help="train the losses over the N most frequent tokens of the data + the batch labels "
                        "(the frozen LM head's rows for them only; 0 = full vocabulary). Eval is full-vocab.")
    p.add_argument("--anchor-tokens", choices=ANCHOR_TOKENS, default=_D.anchor_tokens,
                   help="where training anchors come from: 'generated' = the target's regenerated spans only; "
                        "'all' = every position (prompt text too, labels = the real next tokens, TV to the "
                        "target's distribution there: ~3x the anchors of the same data). Eval: generated only.")
    p.add_argument("--eval-every", type=int, default=_D.eval_every)
    p.add_argument("--eval-anchors", type=int, default=_D.eval_anchors)
    p.add_argument("--save-every", type=int, default=_D.save_every)
    p.add_argument("--log-every", type=int, default=_D.log_every, help="log the mean training loss every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/<stage>/ckpt.pt (also with another number of processes)")
    p.add_argument("--seed", type=int, default=_D.seed)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads per process")
    p.add_argument("--ddp", type=int, default=None, help=argparse.SUPPRESS)  # removed: refused with a message
    p.add_argument("--num-context-positions", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--target-layer-ids", default=None)
    p.add_argument("--head-input", choices=HEAD_INPUTS, default=None,
                   help="what the low-rank RNN head consumes: 'hidden' (default: the previous position's backbone "
                        "state; one vocabulary projection for all K) or 'token' (the previous draft token's "
                        "embedding, teacher-forced in training; K sequential projections when drafting)")
    p.add_argument("--stage-budget-min", type=str, default=None,
                   help="wall-time cap per stage in minutes: one value for every stage, or "
                        "teacher,distill,stabilize values (e.g. 14,14,17); the cosine schedule is re-planned to fit. "
                        "With --single-stage, one value is the stabilize stage's budget and three values give it "
                        "their sum (the two-stage recipe's total, for equal-compute ablations)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stream-window", type=int, default=_D.stream_window,
                   help="stream training batches from W shards at a time (seeded shard order per epoch, every anchor "
                        "once per epoch; the position is saved in the checkpoint, so --resume continues the same data "
                        "order); 0 = sample from the whole set (small data)")
    p.add_argument("--shards", nargs="+", default=None, metavar="SPEC",
                   help="train (and evaluate) on these shards of --data only: SOURCE (all of it), SOURCE:LO-HI "
                        "(shard indices, inclusive) or a file glob, e.g. `--shards sharegpt:94-121 codegen:16-43 "
                        "agent` (a fine-tune on the shards a checkpoint has not seen, without copying data)")
    p.add_argument("--eval-shards", type=int, default=_D.eval_shards,
                   help="with --stream-window: evaluate on the held-out sequences of this many evenly spaced shards")
    p.add_argument("--stop-after-min", type=float, default=None,
                   help="pause this process after M minutes (checkpoint saved, schedule unchanged); rerun the same "
                        "command with --resume to continue (a run spanning several working periods)")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="pause after N steps of this run (checkpoint saved); --resume continues")
    p.add_argument("--init-from-target-layers", default=None,
                   help="comma-separated target layer ids copied into the fresh drafter's backbone layers "
                        "(e.g. 13,14: the layers right after the captured layer 12); default: random init")
    p.add_argument("--init-from-drafter", default=None, metavar="CKPT",
                   help="start the stabilize stage from this trained DLite checkpoint (same drafter options; "
                        "a second epoch or a fine-tune on new data); excludes --init-from-target-layers")
    p.add_argument("--engine-eval-convs", type=int, default=0,
                   help="at the end of each stage, measure tau through the reference engine on this many "
                        "conversations of each --engine-eval-workloads (0: off)")
    p.add_argument("--engine-eval-workloads", default="sharegpt-heldout,agent-stdlib")
    p.add_argument("--engine-eval-max-new-tokens", type=int, default=32)
    p.add_argument("--engine-eval-stages", default=",".join(STAGES))


DDP_REMOVED = ("--ddp was removed: launch data-parallel training with torchrun, e.g. `torchrun --nproc-per-node N "
               "-m sglang_dlite train ...` (gloo on the CPU, NCCL on GPUs; --batch-size is per process).")


# the options whose CLI flag names the field (``--batch-size`` -> ``batch_size``)
_SAME_NAME = ("lr", "batch_size", "seqs_per_batch", "warmup_frac", "gamma", "ce_weight", "tv_weight", "kl_weight", "clip",
              "bf16", "ema_decay", "device", "log_every", "eval_every", "eval_anchors", "save_every", "seed",
              "vocab_subset", "anchor_tokens", "resume", "stream_window", "eval_shards", "shards", "stop_after_steps")


def options_from_args(args) -> TrainOptions:
    """The options of a namespace parsed by ``add_arguments``, checked."""
    if args.ddp not in (None, 1):
        raise DLiteConfigError(DDP_REMOVED)
    stages = ["stabilize"] if args.single_stage else [s.strip() for s in args.stages.split(",") if s.strip()]
    ov = {k: getattr(args, k) for k in ("num_context_positions", "num_layers", "head_input") if getattr(args, k) is not None}
    if args.target_layer_ids:
        ov["target_layer_ids"] = [int(x) for x in args.target_layer_ids.split(",")]
    budget = None
    if args.stage_budget_min:
        vals = [float(x) for x in str(args.stage_budget_min).split(",")]
        one = len(vals) == 1
        if one:
            vals = vals * len(STAGES)
        if len(vals) != len(STAGES):
            raise DLiteInputError("--stage-budget-min takes one value or one per stage (teacher,distill,stabilize).")
        budget = {s: v * 60 for s, v in zip(STAGES, vals)}
        if args.single_stage:  # one value: the stage's own budget; three: the recipe's total
            budget["stabilize"] = (vals[0] if one else sum(vals)) * 60
    weights = {"--ce-weight": args.ce_weight, "--tv-weight": args.tv_weight, "--kl-weight": args.kl_weight}
    if any(w < 0 for w in weights.values()) or not any(weights.values()):
        raise DLiteInputError("the stabilize loss weights must be >= 0 and not all 0 (got "
                              + ", ".join(f"{k} {v:g}" for k, v in weights.items()) + ").")
    if not 0.0 <= args.ema_decay < 1.0:
        raise DLiteInputError(f"--ema-decay must be in [0, 1) (0: off), got {args.ema_decay:g}.")
    if args.init_from_drafter:
        if args.init_from_target_layers:
            raise DLiteInputError("--init-from-drafter and --init-from-target-layers both set the starting weights; "
                                  "pass one.")
        if list(stages) != ["stabilize"]:
            raise DLiteInputError("--init-from-drafter starts the stabilize stage alone; add --single-stage.")
    return TrainOptions(
        stages=stages, steps={s: getattr(args, f"steps_{s}") for s in STAGES}, student_history=args.history,
        init_layers=[int(x) for x in args.init_from_target_layers.split(",")] if args.init_from_target_layers else None,
        init_drafter=args.init_from_drafter, progress=not args.no_progress, config_overrides=ov, time_budget_s=budget,
        stop_after_s=None if args.stop_after_min is None else args.stop_after_min * 60,
        **{k: getattr(args, k) for k in _SAME_NAME},
    )
