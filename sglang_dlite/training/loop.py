"""One training stage: the optimizer loop (schedule, batches, losses, data parallelism,
evaluation, checkpoints).

Device: the drafter, the frozen embedding / LM head and every batch live on
``distributed.STATE.device`` (batches through pinned memory on a GPU); bf16 autocast on that
device (``TrainOptions.bf16``; default on for CUDA, off on the CPU).

Data parallelism (torchrun): every step draws the **global** batch (``seqs_per_batch x world``
groups of ``batch_size / seqs_per_batch`` anchors) from one generator, identical on every rank,
and each rank trains on its ``rank_slice``. Each rank's loss is scaled by its share of the global
normalizer (valid, position-weighted labels), and the training-time vocabulary subset is the
global batch's, so the DDP-averaged gradient equals the one-process gradient of the global batch:
N processes with ``--batch-size B`` follow the loss curve of one process with ``N*B``.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from typing import Optional

import numpy as np
import torch

from ..errors import DLiteConfigError
from ..model import DLiteDrafter
from . import distributed as dist
from .checkpoint import load_checkpoint, log_metrics, plot_curves, save_checkpoint
from .data import DataError
from .dataset import FeatureData, _hist_mode, batch_vocab_subset, concat_groups, eval_groups, sample_batch, to_device
from .ema import WeightEMA
from .evaluation import evaluate, model_forward
from .losses import forward_kl, kl_to_target, position_weights, tv_distance, weighted_ce
from .options import STAGES, Stage, TrainOptions
from .precision import warn_if_emulated_bf16

# the target's frozen tensors bound into the drafter: never trained, identical on every rank
_FROZEN = ("embed_weight", "lm_head_weight", "draft_head_weight")


class Paused(Exception):
    """A stage stopped by --stop-after-min / --stop-after-steps: its checkpoint is saved; rerun with --resume."""


def target_probs(head_w, target_hidden, dtype, vocab=None):
    with torch.no_grad():
        w = head_w if vocab is None else head_w[vocab]
        logits = torch.nn.functional.linear(target_hidden.to(dtype), w.to(dtype))
        return torch.softmax(logits.float(), dim=-1)


def lr_at(step: int, total: int, base: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


class _Forward(torch.nn.Module):
    """The drafter's training forward as one module call (what DDP wraps: its hooks must see it)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, b, vocab=None):
        return model_forward(self.model, b, vocab)


def use_bf16(opts: TrainOptions, device: torch.device) -> bool:
    return bool(opts.bf16) if opts.bf16 is not None else device.type == "cuda"


def run_stage(spec: Stage, model: DLiteDrafter, data: FeatureData, out_dir: str, opts: TrainOptions,
              embed_w, head_w, teacher: Optional[DLiteDrafter] = None) -> DLiteDrafter:
    from tqdm.auto import tqdm

    st_ = dist.STATE
    dev, world, main = st_.device, st_.world, dist.is_main()
    sdir = os.path.join(out_dir, spec.name)
    os.makedirs(sdir, exist_ok=True)
    model.to(dev)
    if teacher is not None:
        teacher.to(dev)
    head_w = model.lm_head_weight  # the bound LM head, on the device
    cfg = model.config
    C, K = cfg.num_context_positions, cfg.block_size
    weights = position_weights(K, opts.gamma)
    weights_dev = weights.to(dev)
    hist = _hist_mode(cfg)
    S = opts.seqs_per_batch
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    ema = WeightEMA(params, opts.ema_decay) if opts.ema_decay > 0 else None
    step = 0
    # the global batch generator: the same stream on every rank, whatever the world size
    rng = np.random.default_rng([opts.seed, STAGES.index(spec.name), 0])
    stream = getattr(data, "stream", None)
    if stream is not None:
        stream.start([opts.seed, STAGES.index(spec.name)])
    elif world > 1 and S * world > len(data.train_idx):
        raise DLiteConfigError(f"{world} processes x --seqs-per-batch {S} = {S * world} sequences per step, but the data "
                               f"has {len(data.train_idx)} training sequences; lower --seqs-per-batch or use fewer processes.")
    ckpt = os.path.join(sdir, "ckpt.pt")
    total = spec.steps
    wall_used = 0.0
    have = opts.resume and os.path.isfile(ckpt)
    if world > 1 and opts.resume:
        n = int(dist.reduce_scalars([1.0 if have else 0.0])[0])
        if 0 < n < world:
            raise DLiteConfigError(f"--resume: {ckpt!r} is visible to {n} of {world} processes; --out must be on a "
                                   "file system that every node shares.")
    if have:
        st = load_checkpoint(ckpt)
        model.load_state_dict(st["model"], strict=False)
        optim.load_state_dict(st["optim"])  # its state follows the parameters' device
        step, wall_used = st["step"], st.get("wall", 0.0)
        # the schedule as saved (re-planned for a time budget), unless this run asks for another
        # number of steps than the saved run did: then the run is extended (or shortened) to it
        extended = st.get("requested", spec.steps) != spec.steps
        total = max(spec.steps, step) if extended else st.get("total", spec.steps)
        rng.bit_generator.state = st["rng"]
        if ema is not None:
            if "ema" in st:
                ema.load_state_dict(st["ema"])
            elif main:
                print(f"train[{spec.name}]: the checkpoint has no weight average; --ema-decay starts one at step {step}")
        torch.set_rng_state(st["torch_rng"])
        if stream is not None:
            if "stream" not in st:
                raise DataError(f"checkpoint {ckpt!r} was not written by a streaming run; resume without --stream-window.")
            stream.load_state_dict(st["stream"])
        if main:
            was = st.get("world_size", 1)
            note = ""
            if st.get("global_batch", opts.batch_size * world) != opts.batch_size * world:
                note = (f" (global batch {st.get('global_batch')} -> {opts.batch_size * world} anchors: "
                        f"{was} -> {world} processes x --batch-size {opts.batch_size})")
            if extended:
                note += f" (extended: {st.get('requested')} -> {spec.steps} steps requested)"
            print(f"train[{spec.name}]: resumed at step {step}/{total}, written by {was} process(es){note}")
    bf16 = use_bf16(opts, dev)
    if bf16 and dev.type == "cpu" and main:
        warn_if_emulated_bf16(f"train[{spec.name}]")

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def save():
        extra = {"stream": stream.state_dict()} if stream is not None else {}
        save_checkpoint(ckpt, {"model": model.state_dict(), "optim": optim.state_dict(), "step": step, "total": total,
                               "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "wall": wall_used,
                               "requested": spec.steps,
                               "world_size": world, "global_batch": opts.batch_size * world,
                               "global_seqs_per_batch": S * world, **extra,
                               **({"ema": ema.state_dict()} if ema is not None else {})})

    fwd = dist.wrap(_Forward(model), ignore=_FROZEN)
    egroups = eval_groups(data, opts.eval_anchors, seed=opts.seed + 99)
    base_vocab = data.frequent_tokens(opts.vocab_subset) if opts.vocab_subset else None
    budget = (opts.time_budget_s or {}).get(spec.name)
    model.train()
    if teacher is not None:
        teacher.eval()
    bar = tqdm(total=total, initial=step, desc=f"train[{spec.name}]", disable=not opts.progress or not main, unit="step")
    t_last, n_anchor, loss_acc, gn, n_acc = time.time(), 0, 0.0, 0.0, 0
    t_proc, steps_here = opts.started_at or time.time(), 0
    want_t = "tv" in spec.loss
    all_tok = data.anchor_tokens == "all"
    while step < total:
        t0 = time.time()
        warmup = max(1, int(opts.warmup_frac * total))  # of the schedule as (re-)planned for the budget
        lr = lr_at(step, total, spec.lr, warmup)
        for g in optim.param_groups:
            g["lr"] = lr
        # the global batch, then this rank's share of it
        if stream is not None:
            refs = dist.rank_slice(stream.next_batch(S * world))
            groups = [(r, r[3]) for r in refs]
            bs = [stream.group(r, C, K, hist, want_t, all_tok) for r in refs]
        else:
            groups = dist.rank_slice(sample_batch(data, rng, opts.batch_size * world, S * world))
            bs = [data.group(si, a, C, K, hist, want_t, all_tok) for si, a in groups]
        tbs = None
        if teacher is not None:
            if stream is not None:
                tbs = [stream.group(r, C, K, _hist_mode(teacher.config), False, all_tok) for r in refs]
            else:
                tbs = [data.group(si, a, C, K, _hist_mode(teacher.config), False, all_tok) for si, a in groups]
        if hist == 0:
            bs = [concat_groups(bs)]
        counts = [int(b["valid"].sum()) for b in bs]
        n_total = sum(counts)
        scale = 1.0
        if world > 1:
            # this rank's share of the global loss normalizer (the losses' own, for one concatenated batch)
            mine = float((bs[0]["valid"].float() * weights[None]).sum()) if hist == 0 else float(n_total)
            glob = dist.reduce_scalars([mine])[0]
            scale = world * mine / glob if glob > 0 else 1.0
        vocab = None
        if base_vocab is not None:
            # training-time vocabulary subset: frequent tokens + every label of the (global) batch
            vocab, subs = batch_vocab_subset(base_vocab, [b["labels"] for b in bs], [b["valid"] for b in bs],
                                             cfg.vocab_size, union=dist.union_mask if world > 1 else None)
            for b, sub in zip(bs, subs):
                b["labels_sub"] = sub
            vocab = vocab.to(dev)
        bs = [to_device(b, dev) for b in bs]
        optim.zero_grad(set_to_none=True)
        step_loss = 0.0
        t_logits_all = None
        if teacher is not None:
            with torch.no_grad(), autocast():
                t_logits_all = torch.cat([model_forward(teacher, to_device(tb, dev), vocab).float() for tb in tbs], 0)
        row = 0
        for j, b in enumerate(bs):
            sync = world == 1 or j == len(bs) - 1  # gradients all-reduced once, after the last group
            with (nullcontext() if sync else fwd.no_sync()):
                with autocast():
                    logits = fwd(b, vocab)
                w = counts[j] / max(n_total, 1) * scale
                labels = b["labels_sub"] if vocab is not None else b["labels"]
                if spec.loss == "ce":
                    loss = weighted_ce(logits, labels, b["valid"], weights_dev)
                elif spec.loss == "kl":
                    tl = t_logits_all[row:row + logits.shape[0]]
                    loss = forward_kl(tl, logits, b["valid"], weights_dev)
                else:
                    p = target_probs(head_w, b["target_hidden"], torch.bfloat16 if bf16 else torch.float32, vocab)
                    # only the terms with a non-zero weight are computed (ablations such as --ce-weight 0)
                    terms = [(opts.ce_weight, lambda: weighted_ce(logits, labels, b["valid"], weights_dev)),
                             (opts.tv_weight, lambda: tv_distance(p, logits, b["valid"], weights_dev)),
                             (opts.kl_weight, lambda: kl_to_target(p, logits, b["valid"], weights_dev))]
                    loss = sum(wt * fn() for wt, fn in terms if wt)
                row += logits.shape[0]
                (loss * w).backward()
            step_loss = step_loss + loss.detach() * (w / world)  # this rank's part of the global mean loss
        n_anchor += world * sum(len(a) for _, a in groups)
        gn = torch.nn.utils.clip_grad_norm_(params, opts.clip)
        optim.step()
        if ema is not None:
            ema.update(step)
        step += 1
        wall_used += time.time() - t0
        loss_acc = loss_acc + step_loss
        n_acc += 1
        bar.update(1)
        if step % opts.log_every == 0 or step == total:
            loss_mean = dist.reduce_scalars([float(loss_acc)])[0] / n_acc
            el = time.time() - t_last
            bar.set_postfix_str(f"loss {loss_mean:.3f} lr {lr:.2e} {n_anchor / max(el, 1e-9):.0f} anchors/s")
            if main:
                log_metrics(out_dir, {"stage": spec.name, "step": step, "loss": loss_mean, "lr": lr,
                                      "grad_norm": float(gn), "anchors_per_s": round(n_anchor / max(el, 1e-9), 1),
                                      "wall_s": round(wall_used, 1),
                                      **({"epochs": round(stream.epochs_done, 4)} if stream is not None else {})})
            loss_acc, n_acc, n_anchor, t_last = 0.0, 0, 0, time.time()
        if budget is not None and step % 5 == 0 and step < total:
            # wall-time cap: re-plan the number of steps from the measured step time, so the
            # warm-up + cosine schedule still completes inside the budget
            per = wall_used / max(step, 1)
            total = max(step + 1, min(total, step + int(max(0.0, budget - wall_used) / max(per, 1e-6))))
            total = dist.min_int(total)
            bar.total = total
        if (step % opts.eval_every == 0 or step >= total) and main:
            with (ema.swapped() if ema is not None else nullcontext()):  # the average is what ships
                ev = evaluate(model, data, egroups, autocast, device=dev)
                rec = {"stage": spec.name, "step": step, **ev,
                       **({"epochs": round(stream.epochs_done, 4)} if stream is not None else {})}
                if opts.engine_eval is not None and step >= total and spec.name in opts.engine_eval_stages:
                    rec.update(opts.engine_eval(model, spec.name, step) or {})
            log_metrics(out_dir, rec)
            bar.write(f"train[{spec.name}] step {step}: held-out tau~{ev['tau_proxy']:.3f} acc/pos {ev['acc_per_pos']}")
            plot_curves(out_dir)
        if (step % opts.save_every == 0 or step >= total) and main:
            save()
        steps_here += 1
        stop = step < total and ((opts.stop_after_steps is not None and steps_here >= opts.stop_after_steps)
                                 or (opts.stop_after_s is not None and time.time() - t_proc > opts.stop_after_s))
        if world > 1 and opts.stop_after_s is not None:
            stop = dist.any_rank(stop)  # the clocks differ: every rank pauses at the same step
        if stop:
            if main:
                save()
            bar.close()
            dist.barrier()
            if main:
                print(f"train[{spec.name}]: paused at step {step}/{total} (checkpoint saved); rerun with --resume to continue")
            raise Paused(spec.name)
    bar.close()
    if ema is not None:
        ema.copy_to_params()  # the saved drafter and the next stage's start are the average
    if main:
        model.save_pretrained(os.path.join(sdir, "model"))
        with open(os.path.join(sdir, "DONE.json"), "w") as f:
            json.dump({"steps": step, "wall_s": round(wall_used, 1), "loss": spec.loss, "lr": spec.lr,
                       "history": cfg.history, "processes": world, "device": dev.type,
                       "requested": spec.steps}, f)
        if getattr(data, "data_dir", None):  # training.json beside the model's config.json
            from .run_summary import summarize, training_record, write_training_json

            write_training_json(os.path.join(sdir, "model"), training_record(summarize(out_dir, data.data_dir), spec.name))
        plot_curves(out_dir)
    dist.barrier()
    return model
