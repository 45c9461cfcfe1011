"""`sglang-dlite train`: the two-stage DLite recipe on cached target features.

Stages (``--stages``, default ``teacher,distill,stabilize``):

1. **teacher**   the history-aware teacher (``history=full``: the same backbone, whose attention
   also sees the target features of every earlier position), token-level cross-entropy over the
   K draft positions of many random anchors per sequence.
2. **distill**   DLite (``history=none``, or ``--history window:W`` for the sliding-window
   ablation), initialized from the teacher's weights (the two share every parameter), trained
   with forward KL(teacher || student), position weights w_i = exp(-(i-1)/gamma).
3. **stabilize** no teacher: CE + total-variation distance to the target's distribution (the
   frozen LM head applied to the cached final-norm hidden states), same weights.

``--single-stage`` = stabilization only, from scratch (the ablation).

Round semantics (as the engine runs them): an anchor at position n sees the captured hidden
states of positions n-C..n-1 (invalid below 0), the anchor token x_n, and predicts x_{n+1..n+K};
the target's distribution for draft position i is its prediction at position n+i-1. Only anchors
whose next token lies in a generated (assistant) span count; label positions outside such spans
are ignored.

Training reads the memory-mapped target features (features.py), never the target. Each stage
writes ``OUT/<stage>/ckpt.pt`` every ``--save-every`` steps (``--resume`` continues from it, under
any number of processes) and ``OUT/<stage>/model/`` when it finishes; a finished stage is skipped
on resume. ``OUT/metrics.jsonl`` and ``OUT/curve.png`` record loss and tau. ``--device``: CUDA
when available (bf16 autocast there); under ``torchrun --nproc-per-node N -m sglang_dlite train``
each rank trains on its slice of every global batch, ``--batch-size`` per process (distributed.py).

The code: options.py (every option, once), dataset.py / stream.py (batches), loop.py (one stage:
schedule, losses, DDP, checkpoints), stages.py (the recipe's stages), evaluation.py, checkpoint.py,
distributed.py; this module is the CLI.
"""

from __future__ import annotations

import torch

from sglang_dlite.model.bundled_target import load_target
from dlite_lab.training import distributed as dist
from dlite_lab.training.dataset import FeatureData, eval_groups, sample_batch  # noqa: F401 - the trainer's public names
from dlite_lab.training.evaluation import evaluate, make_engine_eval  # noqa: F401 - evaluate: the trainer's public name
from dlite_lab.training.loop import Paused, lr_at, run_stage, target_probs  # noqa: F401
from dlite_lab.training.options import STAGES, Stage, TrainOptions, add_arguments, options_from_args  # noqa: F401
from dlite_lab.training.stages import init_from_drafter, init_from_target_layers, make_config, train_pipeline  # noqa: F401


def run(args) -> int:
    """`sglang-dlite train`: one process, or one rank of a torchrun launch (the env says which)."""
    opts = options_from_args(args)  # refuses the removed --ddp before anything loads
    torch.set_num_threads(args.threads)
    dist.setup(opts.device)
    try:
        target, tok = load_target(args.target)
        if getattr(args, "engine_eval_convs", 0) and dist.is_main():
            opts.engine_eval_stages = tuple(args.engine_eval_stages.split(","))
            opts.engine_eval = make_engine_eval(target, tok, args.engine_eval_workloads.split(","),
                                                args.engine_eval_convs, args.engine_eval_max_new_tokens)
        done = train_pipeline(target, args.data, args.out, opts)
        if dist.is_main():
            for k, v in done.items():
                print(f"train: {k} -> {v}")
    finally:
        dist.shutdown()
    return 0
