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
from tqdm.auto import tqdm

from sglang_dlite.errors import DLiteConfigError
from sglang_dlite.model.dlite import DLiteDrafter
from dlite_lab.training import distributed as dist
from dlite_lab.training.checkpoint import load_checkpoint, log_metrics, plot_curves, save_checkpoint
from dlite_lab.training.data import DataError
from dlite_lab.training.dataset import FeatureData, batch_vocab_subset, concat_groups, eval_groups, sample_batch, to_device
from dlite_lab.training.ema import WeightEMA
from dlite_lab.training.evaluation import evaluate, model_forward
from dlite_lab.training.losses import forward_kl, kl_to_target, position_weights, tv_distance, weighted_ce
from dlite_lab.training.options import STAGES, Stage, TrainOptions
from dlite_lab.training.precision import warn_if_emulated_bf16
from dlite_lab.training.run_summary import summarize, training_record, write_training_json

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
              teacher: Optional[DLiteDrafter] = None) -> DLiteDrafter:
    """Train ``model`` (its target embedding and LM head bound in) for one stage (``spec``): resumed
    from the stage's checkpoint with --resume, evaluated and saved as the options ask; raises
    ``Paused`` when --stop-after-* stops it early."""
    run = _StageRun(spec, model, data, out_dir, opts, teacher)
    run.resume()
    run.start()
    while run.step < run.total:
        run.train_step()
        run.after_step()
    return run.finish()


class _StageRun:
    """One stage's state (drafter, optimizer, weight average, batch generator, schedule) and its
    steps; ``run_stage`` drives it."""

    def __init__(self, spec: Stage, model: DLiteDrafter, data: FeatureData, out_dir: str, opts: TrainOptions,
                 teacher: Optional[DLiteDrafter]):
        st_ = dist.STATE
        self.spec, self.model, self.data, self.out_dir, self.opts, self.teacher = spec, model, data, out_dir, opts, teacher
        self.dev, self.world, self.main = st_.device, st_.world, dist.is_main()
        self.sdir = os.path.join(out_dir, spec.name)
        os.makedirs(self.sdir, exist_ok=True)
        model.to(self.dev)
        if teacher is not None:
            teacher.to(self.dev)
        self.head_w = model.lm_head_weight  # the bound LM head, on the device
        self.cfg = cfg = model.config
        self.C, self.K = cfg.num_context_positions, cfg.block_size
        self.weights = position_weights(self.K, opts.gamma)
        self.weights_dev = self.weights.to(self.dev)
        self.hist = cfg.history_window  # 0 none, None full, W window
        self.S = opts.seqs_per_batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
        self.ema = WeightEMA(self.params, opts.ema_decay) if opts.ema_decay > 0 else None
        self.step = 0
        # the global batch generator: the same stream on every rank, whatever the world size
        self.rng = np.random.default_rng([opts.seed, STAGES.index(spec.name), 0])
        self.stream = getattr(data, "stream", None)
        if self.stream is not None:
            self.stream.start([opts.seed, STAGES.index(spec.name)])
        elif self.world > 1 and self.S * self.world > len(data.train_idx):
            raise DLiteConfigError(f"{self.world} processes x --seqs-per-batch {self.S} = {self.S * self.world} sequences "
                                   f"per step, but the data has {len(data.train_idx)} training sequences; lower "
                                   "--seqs-per-batch or use fewer processes.")
        self.ckpt = os.path.join(self.sdir, "ckpt.pt")
        self.total = spec.steps
        self.wall_used = 0.0

    def resume(self) -> None:
        """With --resume and the stage's checkpoint: model, optimizer, average, schedule, generators."""
        spec, opts, world = self.spec, self.opts, self.world
        have = opts.resume and os.path.isfile(self.ckpt)
        if world > 1 and opts.resume:
            n = int(dist.reduce_scalars([1.0 if have else 0.0])[0])
            if 0 < n < world:
                raise DLiteConfigError(f"--resume: {self.ckpt!r} is visible to {n} of {world} processes; --out must be "
                                       "on a file system that every node shares.")
        if not have:
            return
        st = load_checkpoint(self.ckpt)
        self.model.load_state_dict(st["model"], strict=False)
        self.optim.load_state_dict(st["optim"])  # its state follows the parameters' device
        self.step, self.wall_used = st["step"], st.get("wall", 0.0)
        # the schedule as saved (re-planned for a time budget), unless this run asks for another
        # number of steps than the saved run did: then the run is extended (or shortened) to it
        extended = st.get("requested", spec.steps) != spec.steps
        self.total = max(spec.steps, self.step) if extended else st.get("total", spec.steps)
        self.rng.bit_generator.state = st["rng"]
        if self.ema is not None:
            if "ema" in st:
                self.ema.load_state_dict(st["ema"])
            elif self.main:
                print(f"train[{spec.name}]: the checkpoint has no weight average; --ema-decay starts one at step {self.step}")
        torch.set_rng_state(st["torch_rng"])
        if self.stream is not None:
            if "stream" not in st:
                raise DataError(f"checkpoint {self.ckpt!r} was not written by a streaming run; resume without --stream-window.")
            self.stream.load_state_dict(st["stream"])
        if self.main:
            was = st.get("world_size", 1)
            note = ""
            if st.get("global_batch", opts.batch_size * world) != opts.batch_size * world:
                note = (f" (global batch {st.get('global_batch')} -> {opts.batch_size * world} anchors: "
                        f"{was} -> {world} processes x --batch-size {opts.batch_size})")
            if extended:
                note += f" (extended: {st.get('requested')} -> {spec.steps} steps requested)"
            print(f"train[{spec.name}]: resumed at step {self.step}/{self.total}, written by {was} process(es){note}")

    def start(self) -> None:
        """Precision, the DDP-wrapped forward, the held-out anchors, the progress bar and counters."""
        opts, spec = self.opts, self.spec
        self.bf16 = use_bf16(opts, self.dev)
        if self.bf16 and self.dev.type == "cpu" and self.main:
            warn_if_emulated_bf16(f"train[{spec.name}]")
        self.fwd = dist.wrap(_Forward(self.model), ignore=_FROZEN)
        self.egroups = eval_groups(self.data, opts.eval_anchors, seed=opts.seed + 99)
        self.base_vocab = self.data.frequent_tokens(opts.vocab_subset) if opts.vocab_subset else None
        self.budget = (opts.time_budget_s or {}).get(spec.name)
        self.model.train()
        if self.teacher is not None:
            self.teacher.eval()
        self.bar = tqdm(total=self.total, initial=self.step, desc=f"train[{spec.name}]",
                        disable=not opts.progress or not self.main, unit="step")
        self.t_last, self.n_anchor, self.loss_acc, self.gn, self.n_acc = time.time(), 0, 0.0, 0.0, 0
        self.t_proc, self.steps_here = opts.started_at or time.time(), 0
        self.want_t = "tv" in spec.loss
        self.all_tok = self.data.anchor_tokens == "all"

    def autocast(self):
        return torch.autocast(self.dev.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def save(self) -> None:
        extra = {"stream": self.stream.state_dict()} if self.stream is not None else {}
        save_checkpoint(self.ckpt, {
            "model": self.model.state_dict(), "optim": self.optim.state_dict(), "step": self.step, "total": self.total,
            "rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "wall": self.wall_used,
            "requested": self.spec.steps, "world_size": self.world, "global_batch": self.opts.batch_size * self.world,
            "global_seqs_per_batch": self.S * self.world, **extra,
            **({"ema": self.ema.state_dict()} if self.ema is not None else {})})

    def batch(self):
        """This rank's share of the global batch: (groups, the drafter's batches, the teacher's or None)."""
        C, K, all_tok, world = self.C, self.K, self.all_tok, self.world
        if self.stream is not None:  # a group is made from its reference into the stream's window
            refs = dist.rank_slice(self.stream.next_batch(self.S * world))
            groups, keys, group = [(r, r[3]) for r in refs], [(r,) for r in refs], self.stream.group
        else:  # from (sequence, anchors)
            groups = dist.rank_slice(sample_batch(self.data, self.rng, self.opts.batch_size * world, self.S * world))
            keys, group = groups, self.data.group
        bs = [group(*k, C, K, self.hist, self.want_t, all_tok) for k in keys]
        tbs = None if self.teacher is None else [group(*k, C, K, self.teacher.config.history_window, False, all_tok)
                                                 for k in keys]
        if self.hist == 0:
            bs = [concat_groups(bs)]
        return groups, bs, tbs

    def train_step(self) -> None:
        """One optimizer step on the global batch (this rank's share; gradients all-reduced once)."""
        spec, opts, world, dev = self.spec, self.opts, self.world, self.dev
        self.t0 = time.perf_counter()
        warmup = max(1, int(opts.warmup_frac * self.total))  # of the schedule as (re-)planned for the budget
        self.lr = lr_at(self.step, self.total, spec.lr, warmup)
        for g in self.optim.param_groups:
            g["lr"] = self.lr
        groups, bs, tbs = self.batch()
        counts = [int(b["valid"].sum()) for b in bs]
        n_total = sum(counts)
        scale = 1.0
        if world > 1:
            # this rank's share of the global loss normalizer (the losses' own, for one concatenated batch)
            mine = float((bs[0]["valid"].float() * self.weights[None]).sum()) if self.hist == 0 else float(n_total)
            glob = dist.reduce_scalars([mine])[0]
            scale = world * mine / glob if glob > 0 else 1.0
        vocab = None
        if self.base_vocab is not None:
            # training-time vocabulary subset: frequent tokens + every label of the (global) batch
            vocab, subs = batch_vocab_subset(self.base_vocab, [b["labels"] for b in bs], [b["valid"] for b in bs],
                                             self.cfg.vocab_size, union=dist.union_mask if world > 1 else None)
            for b, sub in zip(bs, subs):
                b["labels_sub"] = sub
            vocab = vocab.to(dev)
        bs = [to_device(b, dev) for b in bs]
        self.optim.zero_grad(set_to_none=True)
        t_logits_all = None
        if self.teacher is not None:
            with torch.no_grad(), self.autocast():
                t_logits_all = torch.cat([model_forward(self.teacher, to_device(tb, dev), vocab).float() for tb in tbs], 0)
        step_loss = self.backward(bs, counts, n_total, scale, vocab, t_logits_all)
        self.n_anchor += world * sum(len(a) for _, a in groups)
        self.gn = torch.nn.utils.clip_grad_norm_(self.params, opts.clip)
        self.optim.step()
        if self.ema is not None:
            self.ema.update(self.step)
        self.step += 1
        self.wall_used += time.perf_counter() - self.t0
        self.loss_acc = self.loss_acc + step_loss
        self.n_acc += 1
        self.bar.update(1)

    def backward(self, bs, counts, n_total, scale, vocab, t_logits_all):
        """The stage's loss on each group, backpropagated; returns this rank's part of the global mean loss."""
        spec, opts, world, weights_dev = self.spec, self.opts, self.world, self.weights_dev
        step_loss, row = 0.0, 0
        for j, b in enumerate(bs):
            sync = world == 1 or j == len(bs) - 1  # gradients all-reduced once, after the last group
            with (nullcontext() if sync else self.fwd.no_sync()):
                with self.autocast():
                    logits = self.fwd(b, vocab)
                w = counts[j] / max(n_total, 1) * scale
                labels = b["labels_sub"] if vocab is not None else b["labels"]
                if spec.loss == "ce":
                    loss = weighted_ce(logits, labels, b["valid"], weights_dev)
                elif spec.loss == "kl":
                    tl = t_logits_all[row:row + logits.shape[0]]
                    loss = forward_kl(tl, logits, b["valid"], weights_dev)
                else:
                    p = target_probs(self.head_w, b["target_hidden"], torch.bfloat16 if self.bf16 else torch.float32, vocab)
                    # only the terms with a non-zero weight are computed (ablations such as --ce-weight 0)
                    terms = [(opts.ce_weight, lambda: weighted_ce(logits, labels, b["valid"], weights_dev)),
                             (opts.tv_weight, lambda: tv_distance(p, logits, b["valid"], weights_dev)),
                             (opts.kl_weight, lambda: kl_to_target(p, logits, b["valid"], weights_dev))]
                    loss = sum(wt * fn() for wt, fn in terms if wt)
                row += logits.shape[0]
                (loss * w).backward()
            step_loss = step_loss + loss.detach() * (w / world)  # this rank's part of the global mean loss
        return step_loss

    def after_step(self) -> None:
        """Logging, the time-budget re-plan, evaluation, checkpoints, and a pause (--stop-after-*)."""
        spec, opts, step, stream, main = self.spec, self.opts, self.step, self.stream, self.main
        epochs = {"epochs": round(stream.epochs_done, 4)} if stream is not None else {}
        if step % opts.log_every == 0 or step == self.total:
            loss_mean = dist.reduce_scalars([float(self.loss_acc)])[0] / self.n_acc
            el = time.time() - self.t_last
            self.bar.set_postfix_str(f"loss {loss_mean:.3f} lr {self.lr:.2e} {self.n_anchor / max(el, 1e-9):.0f} anchors/s")
            if main:
                log_metrics(self.out_dir, {"stage": spec.name, "step": step, "loss": loss_mean, "lr": self.lr,
                                           "grad_norm": float(self.gn), "anchors_per_s": round(self.n_anchor / max(el, 1e-9), 1),
                                           "wall_s": round(self.wall_used, 6), **epochs})
            self.loss_acc, self.n_acc, self.n_anchor, self.t_last = 0.0, 0, 0, time.time()
        if self.budget is not None and step % 5 == 0 and step < self.total:
            # wall-time cap: re-plan the number of steps from the measured step time, so the
            # warm-up + cosine schedule still completes inside the budget
            per = self.wall_used / max(step, 1)
            total = max(step + 1, min(self.total, step + int(max(0.0, self.budget - self.wall_used) / max(per, 1e-6))))
            self.total = int(dist.reduce_scalars([total], "min")[0])  # every rank plans the same
            self.bar.total = self.total
        if (step % opts.eval_every == 0 or step >= self.total) and main:
            with (self.ema.swapped() if self.ema is not None else nullcontext()):  # the average is what ships
                ev = evaluate(self.model, self.data, self.egroups, self.autocast, device=self.dev)
                rec = {"stage": spec.name, "step": step, **ev, **epochs}
                if opts.engine_eval is not None and step >= self.total and spec.name in opts.engine_eval_stages:
                    rec.update(opts.engine_eval(self.model, spec.name, step) or {})
            log_metrics(self.out_dir, rec)
            self.bar.write(f"train[{spec.name}] step {step}: held-out tau~{ev['tau_proxy']:.3f} acc/pos {ev['acc_per_pos']}")
            plot_curves(self.out_dir)
        if (step % opts.save_every == 0 or step >= self.total) and main:
            self.save()
        self.steps_here += 1
        stop = step < self.total and ((opts.stop_after_steps is not None and self.steps_here >= opts.stop_after_steps)
                                      or (opts.stop_after_s is not None and time.time() - self.t_proc > opts.stop_after_s))
        if self.world > 1 and opts.stop_after_s is not None:
            stop = dist.any_rank(stop)  # the clocks differ: every rank pauses at the same step
        if stop:
            if main:
                self.save()
            self.bar.close()
            dist.barrier()
            if main:
                print(f"train[{spec.name}]: paused at step {step}/{self.total} (checkpoint saved); rerun with --resume to continue")
            raise Paused(spec.name)

    def finish(self) -> DLiteDrafter:
        """The stage's drafter (the weight average where there is one), saved with DONE.json and training.json."""
        self.bar.close()
        if self.ema is not None:
            self.ema.copy_to_params()  # the saved drafter and the next stage's start are the average
        if self.main:
            spec = self.spec
            self.model.save_pretrained(os.path.join(self.sdir, "model"))
            with open(os.path.join(self.sdir, "DONE.json"), "w") as f:
                json.dump({"steps": self.step, "wall_s": round(self.wall_used, 6), "loss": spec.loss, "lr": spec.lr,
                           "history": self.cfg.history, "processes": self.world, "device": self.dev.type,
                           "requested": spec.steps}, f)
            if getattr(self.data, "data_dir", None):  # training.json beside the model's config.json
                write_training_json(os.path.join(self.sdir, "model"),
                                    training_record(summarize(self.out_dir, self.data.data_dir), spec.name))
            plot_curves(self.out_dir)
        dist.barrier()
        return self.model
