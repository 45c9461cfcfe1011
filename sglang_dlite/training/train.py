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

Everything reads the memory-mapped features: the target never runs during training (features
missing for a shard are computed once, with one batched forward pass, and cached).
Each stage writes ``OUT/<stage>/ckpt.pt`` (model + optimizer + step, every ``--save-every``
steps; ``--resume`` continues from it) and ``OUT/<stage>/model/`` when it finishes; a finished
stage is skipped on resume. ``OUT/metrics.jsonl`` and ``OUT/curve.png`` record loss and tau.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..config import DLiteConfig
from ..errors import DLiteConfigError, DLiteInputError
from ..model import DLiteDrafter
from .data import DataError, read_manifest
from .dataset import (
    ANCHOR_TOKENS, FeatureData, _hist_mode, batch_vocab_subset, concat_groups, eval_groups, sample_batch,
)
from .evaluation import evaluate, make_engine_eval, model_forward
from .losses import forward_kl, position_weights, tv_distance, weighted_ce

STAGES = ("teacher", "distill", "stabilize")

# Data-parallel training over several single-thread processes (``--ddp N``, gloo all-reduce):
# on a shared, loaded CPU several processes get more CPU time than one with several threads.
_DIST = {"rank": 0, "world": 1}


def is_main() -> bool:
    return _DIST["rank"] == 0


def _barrier():
    if _DIST["world"] > 1:
        torch.distributed.barrier()


def _allreduce_grads(params, extra: float) -> float:
    """Average the gradients (and one extra scalar, the loss) over the ranks."""
    if _DIST["world"] == 1:
        return extra
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([extra], dtype=grads[0].dtype)])
    torch.distributed.all_reduce(flat)
    flat /= _DIST["world"]
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        if p.grad is None:
            p.grad = flat[i:i + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[i:i + n].view_as(p))
        i += n
    return float(flat[-1])


def _min_int(x: int) -> int:
    if _DIST["world"] == 1:
        return x
    t = torch.tensor([x], dtype=torch.long)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t)


# ---------------------------------------------------------------------------- model pieces
def bind(model: DLiteDrafter, embed_w, head_w) -> DLiteDrafter:
    return model.bind_target(embed_w, head_w)


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


# ---------------------------------------------------------------------------- stages
@dataclass
class StageSpec:
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
    batch_size: int = 64
    seqs_per_batch: int = 4
    warmup_frac: float = 0.05
    gamma: float = 4.0
    ce_weight: float = 1.0
    tv_weight: float = 1.0
    clip: float = 1.0
    weight_decay: float = 0.01
    bf16: bool = False
    eval_every: int = 100
    eval_anchors: int = 256
    save_every: int = 50
    seed: int = 0
    student_history: str = "none"
    init_layers: Optional[list] = None  # target layer ids the fresh backbones start from (None: random)
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
    stop_after_s: Optional[float] = None  # pause this process (checkpoint, no re-planning) after this wall time
    stop_after_steps: Optional[int] = None  # pause after this many steps of this process (tests)
    started_at: Optional[float] = None  # when this process started training (for stop_after_s)


class Paused(Exception):
    """A stage stopped by --stop-after-min: its checkpoint is saved; rerun with --resume."""


def _log(out_dir, rec):
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def plot_curves(out_dir: str) -> Optional[str]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = [json.loads(x) for x in open(path) if x.strip()]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for st in STAGES:
        tr = [r for r in recs if r.get("stage") == st and "loss" in r]
        ev = [r for r in recs if r.get("stage") == st and "tau_proxy" in r]
        if not tr and not ev:
            continue
        if tr:
            ax[0].plot([offset + r["step"] for r in tr], [r["loss"] for r in tr], label=st)
        if ev:
            ax[1].plot([offset + r["step"] for r in ev], [r["tau_proxy"] for r in ev], marker="o", label=st)
        offset += max([r["step"] for r in tr + ev] + [0])
    ax[0].set_xlabel("step (stages concatenated)"); ax[0].set_ylabel("training loss"); ax[0].set_yscale("log"); ax[0].legend()
    ax[1].set_xlabel("step"); ax[1].set_ylabel("held-out tau (greedy, expected)"); ax[1].legend()
    fig.tight_layout()
    png = os.path.join(out_dir, "curve.png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def init_from_target_layers(model: DLiteDrafter, target, layer_ids) -> DLiteDrafter:
    """Copy the target's decoder layers ``layer_ids`` (attention, MLP and norms) into the drafter's
    backbone layers, one for one: a drafter that reads layer-12 states starts as the target's own
    next layers instead of from noise. Needs the drafter's layer shapes to equal the target's."""
    inner = getattr(target, "model", target)
    tl = inner.layers
    if len(layer_ids) != len(model.layers):
        raise DLiteConfigError(f"--init-from-target-layers names {len(layer_ids)} layers but the drafter has "
                               f"{len(model.layers)} backbone layers.")
    names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
             "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}
    with torch.no_grad():
        for mine, lid in zip(model.layers, layer_ids):
            if not 0 <= lid < len(tl):
                raise DLiteConfigError(f"--init-from-target-layers: layer {lid} is out of range for a target "
                                       f"with {len(tl)} layers (valid: 0..{len(tl) - 1}).")
            src = tl[lid]
            for a, b in names.items():
                w_dst = getattr(mine, a).weight
                w_src = src.get_submodule(b).weight
                if w_dst.shape != w_src.shape:
                    raise DLiteConfigError(
                        f"--init-from-target-layers: drafter {a} {tuple(w_dst.shape)} != target layer {lid} "
                        f"{b} {tuple(w_src.shape)}; the drafter's heads/head_dim/intermediate size must equal the target's.")
                w_dst.copy_(w_src.to(w_dst.dtype))
    return model


def make_config(target_cfg, history: str, overrides: dict) -> DLiteConfig:
    kw = dict(target_hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
              target_num_layers=target_cfg.num_hidden_layers, target_model_type=getattr(target_cfg, "model_type", None))
    kw.update(overrides)
    kw["history"] = history
    return DLiteConfig(**kw)


def run_stage(spec: StageSpec, model: DLiteDrafter, data: FeatureData, out_dir: str, opts: TrainOptions,
              embed_w, head_w, teacher: Optional[DLiteDrafter] = None) -> DLiteDrafter:
    from tqdm.auto import tqdm

    sdir = os.path.join(out_dir, spec.name)
    os.makedirs(sdir, exist_ok=True)
    cfg = model.config
    C, K = cfg.num_context_positions, cfg.block_size
    weights = position_weights(K, opts.gamma)
    hist = _hist_mode(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    step = 0
    rank = _DIST["rank"]
    rng = np.random.default_rng([opts.seed, STAGES.index(spec.name), rank])
    stream = getattr(data, "stream", None)
    if stream is not None:
        stream.start([opts.seed, STAGES.index(spec.name)])
    ckpt = os.path.join(sdir, "ckpt.pt")
    total = spec.steps
    wall_used = 0.0
    if opts.resume and os.path.isfile(ckpt):
        try:
            st = torch.load(ckpt, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - a corrupt checkpoint: say so
            raise DataError(f"checkpoint {ckpt!r} is unreadable ({exc}); delete it to restart the stage.") from exc
        model.load_state_dict(st["model"], strict=False)
        optim.load_state_dict(st["optim"])
        step, total, wall_used = st["step"], st.get("total", total), st.get("wall", 0.0)
        if rank == 0:
            rng.bit_generator.state = st["rng"]
        else:
            rng = np.random.default_rng([opts.seed, STAGES.index(spec.name), rank, step])
        torch.set_rng_state(st["torch_rng"])
        if stream is not None:
            if "stream" not in st:
                raise DataError(f"checkpoint {ckpt!r} was not written by a streaming run; resume without --stream-window.")
            stream.load_state_dict(st["stream"])
        print(f"train[{spec.name}]: resumed at step {step}/{total}")
    use_bf16 = opts.bf16

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if use_bf16 else nullcontext()

    def save(final=False):
        tmp = ckpt + ".tmp"
        extra = {"stream": stream.state_dict()} if stream is not None else {}
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step, "total": total,
                    "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "wall": wall_used, **extra}, tmp)
        os.replace(tmp, ckpt)

    egroups = eval_groups(data, opts.eval_anchors, seed=opts.seed + 99)
    base_vocab = data.frequent_tokens(opts.vocab_subset) if opts.vocab_subset else None
    budget = (opts.time_budget_s or {}).get(spec.name)
    model.train()
    if teacher is not None:
        teacher.eval()
    bar = tqdm(total=total, initial=step, desc=f"train[{spec.name}]", disable=not opts.progress or not is_main(), unit="step")
    t_last, n_anchor, loss_acc, n_acc = time.time(), 0, 0.0, 0
    t_proc, steps_here = opts.started_at or time.time(), 0
    while step < total:
        t0 = time.time()
        warmup = max(1, int(opts.warmup_frac * total))  # of the schedule as (re-)planned for the budget
        lr = lr_at(step, total, spec.lr, warmup)
        for g in optim.param_groups:
            g["lr"] = lr
        want_t = "tv" in spec.loss
        all_tok = data.anchor_tokens == "all"
        if stream is not None:
            refs = stream.next_batch(opts.seqs_per_batch)
            groups = [(r, r[3]) for r in refs]
            bs = [stream.group(r, C, K, hist, want_t, all_tok) for r in refs]
        else:
            groups = sample_batch(data, rng, opts.batch_size, opts.seqs_per_batch)
            bs = [data.group(si, a, C, K, hist, want_t, all_tok) for si, a in groups]
        tbs = None
        if teacher is not None:
            if stream is not None:
                tbs = [stream.group(r, C, K, _hist_mode(teacher.config), False, all_tok) for r in refs]
            else:
                tbs = [data.group(si, a, C, K, _hist_mode(teacher.config), False, all_tok) for si, a in groups]
        if hist == 0:
            bs = [concat_groups(bs)]
        n_total = sum(int(b["valid"].sum()) for b in bs)
        vocab = None
        if base_vocab is not None:
            # training-time vocabulary subset: frequent tokens + every label of the batch
            vocab, subs = batch_vocab_subset(base_vocab, [b["labels"] for b in bs], [b["valid"] for b in bs],
                                             cfg.vocab_size)
            for b, sub in zip(bs, subs):
                b["labels_sub"] = sub
        optim.zero_grad(set_to_none=True)
        loss_val = 0.0
        t_logits_all = None
        if teacher is not None:
            with torch.no_grad(), autocast():
                t_logits_all = torch.cat([model_forward(teacher, tb, vocab).float() for tb in tbs], 0)
        row = 0
        for b in bs:
            with autocast():
                logits = model_forward(model, b, vocab)
            w = b["valid"].sum().item() / max(n_total, 1)
            labels = b["labels_sub"] if vocab is not None else b["labels"]
            if spec.loss == "ce":
                loss = weighted_ce(logits, labels, b["valid"], weights)
            elif spec.loss == "kl":
                tl = t_logits_all[row:row + logits.shape[0]]
                loss = forward_kl(tl, logits, b["valid"], weights)
            else:
                p = target_probs(head_w, b["target_hidden"], torch.bfloat16 if use_bf16 else torch.float32, vocab)
                loss = opts.ce_weight * weighted_ce(logits, labels, b["valid"], weights) + \
                    opts.tv_weight * tv_distance(p, logits, b["valid"], weights)
            row += logits.shape[0]
            (loss * w).backward()
            loss_val += float(loss.detach()) * w
            n_anchor += logits.shape[0]
        loss_val = _allreduce_grads(params, loss_val)
        n_anchor += (_DIST["world"] - 1) * sum(len(a) for _, a in groups)
        gn = torch.nn.utils.clip_grad_norm_(params, opts.clip)
        optim.step()
        step += 1
        dt = time.time() - t0
        wall_used += dt
        loss_acc += loss_val
        n_acc += 1
        bar.update(1)
        el = time.time() - t_last
        bar.set_postfix_str(f"loss {loss_val:.3f} lr {lr:.2e} {n_anchor / max(el, 1e-9):.0f} anchors/s")
        if (step % 10 == 0 or step == total) and is_main():
            _log(out_dir, {"stage": spec.name, "step": step, "loss": loss_acc / n_acc, "lr": lr,
                           "grad_norm": float(gn), "anchors_per_s": round(n_anchor / max(el, 1e-9), 1),
                           "wall_s": round(wall_used, 1),
                           **({"epochs": round(stream.epochs_done, 4)} if stream is not None else {})})
            loss_acc, n_acc, n_anchor, t_last = 0.0, 0, 0, time.time()
        if budget is not None and step % 5 == 0 and step < total:
            # wall-time cap: re-plan the number of steps from the measured step time, so the
            # warm-up + cosine schedule still completes inside the budget
            per = wall_used / max(step, 1)
            total = max(step + 1, min(total, step + int(max(0.0, budget - wall_used) / max(per, 1e-6))))
            total = _min_int(total)
            bar.total = total
        if (step % opts.eval_every == 0 or step >= total) and is_main():
            ev = evaluate(model, data, egroups, autocast)
            rec = {"stage": spec.name, "step": step, **ev,
                   **({"epochs": round(stream.epochs_done, 4)} if stream is not None else {})}
            if opts.engine_eval is not None and step >= total and spec.name in opts.engine_eval_stages:
                rec.update(opts.engine_eval(model, spec.name, step) or {})
            _log(out_dir, rec)
            bar.write(f"train[{spec.name}] step {step}: held-out tau~{ev['tau_proxy']:.3f} acc/pos {ev['acc_per_pos']}")
            plot_curves(out_dir)
        if (step % opts.save_every == 0 or step >= total) and is_main():
            save()
        steps_here += 1
        if step < total and ((opts.stop_after_steps is not None and steps_here >= opts.stop_after_steps)
                             or (opts.stop_after_s is not None and time.time() - t_proc > opts.stop_after_s)):
            save()
            bar.close()
            print(f"train[{spec.name}]: paused at step {step}/{total} (checkpoint saved); rerun with --resume to continue")
            raise Paused(spec.name)
    bar.close()
    if is_main():
        model.save_pretrained(os.path.join(sdir, "model"))
        with open(os.path.join(sdir, "DONE.json"), "w") as f:
            json.dump({"steps": step, "wall_s": round(wall_used, 1), "loss": spec.loss, "lr": spec.lr,
                       "history": cfg.history, "processes": _DIST["world"]}, f)
        if getattr(data, "data_dir", None):  # training.json beside the model's config.json
            from .run_summary import summarize, training_record, write_training_json

            write_training_json(os.path.join(sdir, "model"), training_record(summarize(out_dir, data.data_dir), spec.name))
        plot_curves(out_dir)
    _barrier()
    return model


def train_pipeline(target, data_dir: str, out_dir: str, opts: TrainOptions) -> dict:
    """Run the stages; returns {stage: model folder}. ``target``: a HF causal LM (frozen)."""
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(opts.seed)
    opts.started_at = opts.started_at or time.time()
    tc = target.config
    student_cfg = make_config(tc, opts.student_history, opts.config_overrides)
    layer_ids = student_cfg.target_layer_ids
    stream_info = None
    if opts.stream_window:
        data, stream_info = _streaming_data(target, data_dir, layer_ids, opts)
    elif is_main():
        data = FeatureData(data_dir, layer_ids, model_loader=lambda: target, progress=opts.progress,
                           anchor_tokens=opts.anchor_tokens)
    _barrier()
    if not is_main() and not opts.stream_window:
        data = FeatureData(data_dir, layer_ids, anchor_tokens=opts.anchor_tokens)
    embed_w = target.get_input_embeddings().weight.detach()
    head_w = target.get_output_embeddings().weight.detach()
    stages = list(opts.stages)
    for s in stages:
        if s not in STAGES:
            raise DLiteInputError(f"unknown stage {s!r}; stages are {','.join(STAGES)}.")
    if "distill" in stages and "teacher" not in stages and not os.path.isfile(os.path.join(out_dir, "teacher", "DONE.json")):
        raise DLiteInputError("the distill stage needs a trained teacher: include 'teacher' in --stages (or train it first into the same --out).")
    info = {"data": data_dir, "train_sequences": len(data.train_idx), "eval_sequences": len(data.eval_idx),
            "train_anchors": data.num_train_anchors, "options": {k: v for k, v in opts.__dict__.items() if k != "engine_eval"}}
    info["processes"] = _DIST["world"]
    if stream_info is not None:  # FeatureData is only the held-out view here
        info.update(stream_info, train_sequences=stream_info["streaming"]["sequences"], train_anchors=None)
    if is_main():
        with open(os.path.join(out_dir, "train_info.json"), "w") as f:
            json.dump(info, f, indent=1, default=str)
    if stream_info is not None:
        sd = stream_info["streaming"]
        print(f"train: streaming {sd['shards']} shards ({sd['sequences']} sequences, {sd['generated_tokens']} generated "
              f"tokens), window {sd['window']}; held-out: {len(data.eval_idx)} sequences of {sd['eval_shards']} shards")
    else:
        print(f"train: {len(data.train_idx)} train / {len(data.eval_idx)} held-out sequences, "
              f"{data.num_train_anchors} training anchors")
    done = {}

    def finished(name):
        return os.path.isfile(os.path.join(out_dir, name, "DONE.json"))

    def load_done(name):
        return bind(DLiteDrafter.from_pretrained(os.path.join(out_dir, name, "model")), embed_w, head_w).train()

    try:
        _run_stages(stages, opts, target, tc, student_cfg, data, out_dir, embed_w, head_w, finished, load_done, done)
    except Paused as p:
        done["paused"] = str(p)
    plot_curves(out_dir)
    return done


def _streaming_data(target, data_dir: str, layer_ids, opts):
    """(held-out FeatureData over ``opts.eval_shards`` evenly spaced shards, with ``.stream`` the
    training ShardStream over every finished shard; info for train_info.json)."""
    from .features import ensure_features
    from .stream import ShardStream

    if _DIST["world"] > 1:
        raise DLiteConfigError("--stream-window runs in one process (no --ddp).")
    shards = read_manifest(data_dir).get("shards", [])
    if not shards:
        raise DataError(f"{data_dir!r} lists no finished shards; run `sglang-dlite gen-data` first.")
    ensure_features(data_dir, shards, lambda: target, layer_ids, progress=opts.progress)
    files = sorted(sh["file"] for sh in shards)
    step = max(1, len(files) // max(1, opts.eval_shards))
    data = FeatureData(data_dir, layer_ids, anchor_tokens=opts.anchor_tokens, shard_files=files[::step][:opts.eval_shards])
    data.stream = ShardStream(data_dir, layer_ids, files, window=opts.stream_window,
                              per=max(1, opts.batch_size // opts.seqs_per_batch), anchor_tokens=opts.anchor_tokens)
    gen = sum(sh["num_loss_tokens"] for sh in shards)
    info = {"streaming": {"window": opts.stream_window, "shards": len(files), "eval_shards": len(files[::step][:opts.eval_shards]),
                          "sequences": sum(sh["num_seqs"] for sh in shards), "tokens": sum(sh["num_tokens"] for sh in shards),
                          "generated_tokens": gen}}
    return data, info


def _run_stages(stages, opts, target, tc, student_cfg, data, out_dir, embed_w, head_w, finished, load_done, done):
    teacher = None
    student = None
    if "teacher" in stages or "distill" in stages:
        if finished("teacher"):
            teacher = load_done("teacher")
        else:
            teacher = bind(DLiteDrafter(make_config(tc, "full", opts.config_overrides)), embed_w, head_w)
            if opts.init_layers:
                init_from_target_layers(teacher, target, opts.init_layers)
            teacher = run_stage(StageSpec("teacher", opts.steps["teacher"], opts.lr, "ce", "full"), teacher, data,
                                out_dir, opts, embed_w, head_w)
        done["teacher"] = os.path.join(out_dir, "teacher", "model")
    if "distill" in stages:
        if finished("distill"):
            student = load_done("distill")
        else:
            student = bind(DLiteDrafter(student_cfg), embed_w, head_w)
            if opts.distill_init == "teacher" and teacher is not None:
                student.load_state_dict(teacher.state_dict(), strict=False)
            for p in teacher.parameters():
                p.requires_grad_(False)
            student = run_stage(StageSpec("distill", opts.steps["distill"], opts.lr, "kl", opts.student_history),
                                student, data, out_dir, opts, embed_w, head_w, teacher=teacher)
        done["distill"] = os.path.join(out_dir, "distill", "model")
    if "stabilize" in stages:
        if finished("stabilize"):
            student = load_done("stabilize")
        else:
            if student is None:
                student = bind(DLiteDrafter(student_cfg), embed_w, head_w)
                if opts.init_layers:
                    init_from_target_layers(student, target, opts.init_layers)
            lr = opts.lr if "distill" not in stages else opts.lr * 0.5
            student = run_stage(StageSpec("stabilize", opts.steps["stabilize"], lr, "ce+tv", opts.student_history),
                                student, data, out_dir, opts, embed_w, head_w)
        done["stabilize"] = os.path.join(out_dir, "stabilize", "model")


# ---------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="gen-data output folder")
    p.add_argument("--out", required=True, help="training output folder (checkpoints, metrics, curve.png)")
    p.add_argument("--target", default="default")
    p.add_argument("--stages", default="teacher,distill,stabilize")
    p.add_argument("--single-stage", action="store_true", help="stabilization only, from scratch (ablation)")
    p.add_argument("--history", default="none", help="student history: none (DLite) | window:W (ablation)")
    p.add_argument("--steps-teacher", type=int, default=300)
    p.add_argument("--steps-distill", type=int, default=300)
    p.add_argument("--steps-stabilize", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64, help="anchors per optimizer step")
    p.add_argument("--seqs-per-batch", type=int, default=4)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--ce-weight", type=float, default=1.0)
    p.add_argument("--tv-weight", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (faster on these CPUs)")
    p.add_argument("--vocab-subset", type=int, default=0,
                   help="train the losses over the N most frequent tokens of the data + the batch labels "
                        "(the frozen LM head's rows for them only; 0 = full vocabulary). Eval is full-vocab.")
    p.add_argument("--anchor-tokens", choices=ANCHOR_TOKENS, default="generated",
                   help="where training anchors come from: 'generated' = the target's regenerated spans only; "
                        "'all' = every position (prompt text too, labels = the real next tokens, TV to the "
                        "target's distribution there: ~3x the anchors of the same data). Eval: generated only.")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-anchors", type=int, default=256)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--ddp", type=int, default=1, help="data-parallel processes (gloo); batch-size is per process")
    p.add_argument("--num-context-positions", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--target-layer-ids", default=None)
    p.add_argument("--stage-budget-min", type=str, default=None,
                   help="wall-time cap per stage in minutes: one value for every stage, or "
                        "teacher,distill,stabilize values (e.g. 14,14,17); the cosine schedule is re-planned to fit. "
                        "With --single-stage, one value is the stabilize stage's budget and three values give it "
                        "their sum (the two-stage recipe's total, for equal-compute ablations)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stream-window", type=int, default=0,
                   help="stream training batches from W shards at a time (seeded shard order per epoch, every anchor "
                        "once per epoch; the position is saved in the checkpoint, so --resume continues the same data "
                        "order); 0 = sample from the whole set (small data)")
    p.add_argument("--eval-shards", type=int, default=32,
                   help="with --stream-window: evaluate on the held-out sequences of this many evenly spaced shards")
    p.add_argument("--stop-after-min", type=float, default=None,
                   help="pause this process after M minutes (checkpoint saved, schedule unchanged); rerun the same "
                        "command with --resume to continue (a run spanning several working periods)")
    p.add_argument("--init-from-target-layers", default=None,
                   help="comma-separated target layer ids copied into the fresh drafter's backbone layers "
                        "(e.g. 13,14: the layers right after the captured layer 12); default: random init")
    p.add_argument("--engine-eval-convs", type=int, default=0,
                   help="at the end of each stage, measure tau through the reference engine on this many "
                        "conversations of each --engine-eval-workloads (0: off)")
    p.add_argument("--engine-eval-workloads", default="sharegpt-heldout,agent-stdlib")
    p.add_argument("--engine-eval-max-new-tokens", type=int, default=32)
    p.add_argument("--engine-eval-stages", default="teacher,distill,stabilize")


def options_from_args(args) -> TrainOptions:
    stages = ["stabilize"] if args.single_stage else [s.strip() for s in args.stages.split(",") if s.strip()]
    ov = {}
    if args.num_context_positions is not None:
        ov["num_context_positions"] = args.num_context_positions
    if args.num_layers is not None:
        ov["num_layers"] = args.num_layers
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
    return TrainOptions(
        stages=stages, steps={"teacher": args.steps_teacher, "distill": args.steps_distill, "stabilize": args.steps_stabilize},
        lr=args.lr, batch_size=args.batch_size, seqs_per_batch=args.seqs_per_batch, warmup_frac=args.warmup_frac,
        gamma=args.gamma, ce_weight=args.ce_weight, tv_weight=args.tv_weight, clip=args.clip, bf16=args.bf16,
        eval_every=args.eval_every, eval_anchors=args.eval_anchors, save_every=args.save_every, seed=args.seed,
        init_layers=[int(x) for x in args.init_from_target_layers.split(",")] if getattr(args, "init_from_target_layers", None) else None,
        student_history=args.history, vocab_subset=args.vocab_subset,
        anchor_tokens=getattr(args, "anchor_tokens", "generated"), resume=args.resume, progress=not args.no_progress, config_overrides=ov,
        time_budget_s=budget, stream_window=getattr(args, "stream_window", 0), eval_shards=getattr(args, "eval_shards", 32),
        stop_after_s=None if getattr(args, "stop_after_min", None) is None else args.stop_after_min * 60,
    )


def _ddp_worker(rank, args, port):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=args.ddp)
    _DIST.update(rank=rank, world=args.ddp)
    try:
        _run(args)
    finally:
        torch.distributed.destroy_process_group()


def run(args) -> int:
    if getattr(args, "ddp", 1) > 1:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        mp.spawn(_ddp_worker, args=(args, port), nprocs=args.ddp, join=True)
        return 0
    return _run(args)


def _run(args) -> int:
    from ..target import load_target

    torch.set_num_threads(args.threads)
    target, tok = load_target(args.target)
    opts = options_from_args(args)
    if getattr(args, "engine_eval_convs", 0) and is_main():
        opts.engine_eval_stages = tuple(args.engine_eval_stages.split(","))
        opts.engine_eval = make_engine_eval(target, tok, args.engine_eval_workloads.split(","),
                                            args.engine_eval_convs, args.engine_eval_max_new_tokens)
    done = train_pipeline(target, args.data, args.out, opts)
    for k, v in done.items():
        if is_main():
            print(f"train: {k} -> {v}")
    return 0
