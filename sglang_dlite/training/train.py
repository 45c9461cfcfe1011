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
import hashlib
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
from ..model import DLiteDrafter, History
from .data import DataError, load_shard, read_manifest
from .features import ensure_features, load_features
from .losses import forward_kl, greedy_accept_length, position_weights, tv_distance, weighted_ce

STAGES = ("teacher", "distill", "stabilize")
ANCHOR_TOKENS = ("generated", "all")

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


# ---------------------------------------------------------------------------- data
class FeatureData:
    """All sequences of a gen-data folder with their memory-mapped target features."""

    def __init__(self, data_dir: str, layer_ids, heldout_mod: int = 16, model_loader=None, progress=True,
                 anchor_tokens: str = "generated", shard_files=None):
        if anchor_tokens not in ANCHOR_TOKENS:
            raise DLiteInputError(f"anchor_tokens must be one of {', '.join(ANCHOR_TOKENS)}, not {anchor_tokens!r}.")
        self.anchor_tokens = anchor_tokens
        self.data_dir = data_dir
        man = read_manifest(data_dir)
        shards = man.get("shards", [])
        if shard_files is not None:  # a subset (the streaming trainer's held-out view)
            keep = set(shard_files)
            shards = [sh for sh in shards if sh["file"] in keep]
        if not shards:
            raise DataError(f"{data_dir!r} lists no finished shards; run `sglang-dlite gen-data` first.")
        if model_loader is not None:
            ensure_features(data_dir, shards, model_loader, layer_ids, progress=progress)
        self.L = len(layer_ids)
        self.shards = []  # (ids, mask, feats)
        self.seqs = []  # (shard index, start, length, generated-span anchors, name)
        for k, sh in enumerate(shards):
            path = os.path.join(data_dir, sh["file"])
            ids, mask, off = load_shard(path)
            feats = load_features(path, layer_ids, len(ids))
            if feats is None:
                raise DataError(f"no features for {path!r} (layers {list(layer_ids)}); run train with the target to compute them.")
            self.shards.append((ids, mask, feats))
            for s in range(len(off) - 1):
                a, b = int(off[s]), int(off[s + 1])
                m = mask[a:b]
                n = np.arange(1, b - a - 1)
                anchors = n[m[n + 1] == 1] if len(n) else n
                if len(anchors):
                    self.seqs.append((k, a, b - a, anchors, f"{sh['file']}:{s}"))
        if not self.seqs:
            raise DataError(f"{data_dir!r} has no sequence with a loss-masked (generated) span.")
        self.hidden = self.shards[0][2].shape[-1]
        held = [i for i, s in enumerate(self.seqs)
                if heldout_mod and int(hashlib.sha256(s[4].encode()).hexdigest(), 16) % heldout_mod == 0]
        if len(held) == len(self.seqs) or not held:  # tiny data: hold out the last sequence
            held = [len(self.seqs) - 1] if len(self.seqs) > 1 else []
        self.eval_idx = held
        self.train_idx = [i for i in range(len(self.seqs)) if i not in set(held)] or list(range(len(self.seqs)))
        self.num_train_anchors = int(sum(len(self.train_anchors(i)) for i in self.train_idx))
        counts = None
        for i in self.train_idx:
            k, a, n, _, _ = self.seqs[i]
            c = np.bincount(self.shards[k][0][a:a + n], minlength=1)
            if counts is None:
                counts = c
            else:
                m = max(len(counts), len(c))
                counts = np.pad(counts, (0, m - len(counts))) + np.pad(c, (0, m - len(c)))
        self.token_counts = counts

    def train_anchors(self, seq_i: int) -> np.ndarray:
        """The anchors training samples from: positions whose next token the target generated
        ("generated"), or every position ("all": prompt text too; its labels are the real next
        tokens and its TV target the target's distribution there)."""
        _, _, length, generated, _ = self.seqs[seq_i]
        return np.arange(1, length - 1) if self.anchor_tokens == "all" else generated

    def frequent_tokens(self, n: int) -> torch.Tensor:
        """The n most frequent token ids of the training sequences (those that occur)."""
        order = np.argsort(-self.token_counts, kind="stable")
        order = order[self.token_counts[order] > 0][:n]
        return torch.from_numpy(np.sort(order).astype(np.int64))

    def group(self, seq_i: int, anchors, C: int, K: int, history: Optional[int], want_target: bool,
              all_tokens: bool = False):
        """Tensors for anchors of one sequence. history: 0 none, None full, W window. Labels are
        valid on generated tokens only, or on every token with ``all_tokens``."""
        k, start, length, _, _ = self.seqs[seq_i]
        ids, mask, feats = self.shards[k]
        return build_group(ids, mask, feats, start, length, anchors, self.L, self.hidden, C, K, history, want_target,
                           all_tokens)


def build_group(ids, mask, feats, start: int, length: int, anchors, L: int, H: int, C: int, K: int,
                history: Optional[int], want_target: bool, all_tokens: bool = False) -> dict:
    """``FeatureData.group`` on raw shard arrays (also used by the streaming loader, stream.py)."""
    n = np.asarray(anchors, dtype=np.int64)
    B = len(n)
    cpos = n[:, None] - C + np.arange(C)[None]  # [B, C]
    cvalid = cpos >= 0
    ctx = np.asarray(feats[start + np.clip(cpos, 0, None).reshape(-1), :L], dtype=np.float32).reshape(B, C, L, H)
    ctx[~cvalid] = 0
    lpos = n[:, None] + 1 + np.arange(K)[None]  # [B, K]
    inside = lpos < length
    lp = np.clip(lpos, 0, length - 1)
    labels = ids[start + lp].astype(np.int64)
    lvalid = inside if all_tokens else inside & (mask[start + lp] == 1)
    out = {
        "context_hidden": torch.from_numpy(ctx).permute(0, 2, 1, 3).contiguous(),
        "context_valid": torch.from_numpy(cvalid),
        "anchor_ids": torch.from_numpy(ids[start + n].astype(np.int64)),
        "labels": torch.from_numpy(labels),
        "valid": torch.from_numpy(lvalid),
        "round_offset": torch.from_numpy(n - C),
    }
    if want_target:
        tpos = np.clip(n[:, None] + np.arange(K)[None], 0, length - 2)
        out["target_hidden"] = torch.from_numpy(
            np.asarray(feats[start + tpos.reshape(-1), L], dtype=np.float32).reshape(B, K, H))
    if history != 0:
        T = max(int(n.max()) - C, 0)
        if T > 0:
            hid = np.asarray(feats[start:start + T, :L], dtype=np.float32)  # [T, L, H]
            hpos = np.arange(T)
            hv = hpos[None, :] < (n[:, None] - C)
            if history is not None:
                hv &= hpos[None, :] >= (n[:, None] - C - history)
            out["history"] = History(
                hidden=torch.from_numpy(hid).permute(1, 0, 2)[None].contiguous(),
                positions=torch.from_numpy(hpos)[None], valid=torch.from_numpy(hv),
            )
    return out


def _hist_mode(cfg: DLiteConfig):
    return cfg.history_window  # 0 none, None full, W window


def sample_batch(data: FeatureData, rng: np.random.Generator, batch_size: int, seqs_per_batch: int):
    """[(seq index, anchors)]: seqs_per_batch random training sequences, random anchors in each."""
    per = max(1, batch_size // seqs_per_batch)
    chosen = rng.choice(len(data.train_idx), size=min(seqs_per_batch, len(data.train_idx)), replace=False)
    groups = []
    for c in chosen:
        si = data.train_idx[c]
        anchors = data.train_anchors(si)
        take = rng.choice(anchors, size=min(per, len(anchors)), replace=False)
        groups.append((si, np.sort(take)))
    return groups


def eval_groups(data: FeatureData, max_anchors: int, seed: int = 1234):
    """A fixed set of held-out anchors, grouped by sequence."""
    rng = np.random.default_rng(seed)
    idx = data.eval_idx or data.train_idx[:1]
    per = max(1, max_anchors // max(len(idx), 1))
    out = []
    for si in idx:
        a = data.seqs[si][3]
        out.append((si, np.sort(rng.choice(a, size=min(per, len(a)), replace=False))))
    return out


# ---------------------------------------------------------------------------- model pieces
def bind(model: DLiteDrafter, embed_w, head_w) -> DLiteDrafter:
    return model.bind_target(embed_w, head_w)


def target_probs(head_w, target_hidden, dtype, vocab=None):
    with torch.no_grad():
        w = head_w if vocab is None else head_w[vocab]
        logits = torch.nn.functional.linear(target_hidden.to(dtype), w.to(dtype))
        return torch.softmax(logits.float(), dim=-1)


def batch_vocab_subset(base_vocab: torch.Tensor, labels: list, valid: list, vocab_size: int):
    """The training-time vocabulary subset of one batch: the frequent tokens ``base_vocab`` plus
    every valid label. Returns (sorted token ids, labels remapped to their index in the subset;
    invalid positions get 0)."""
    vocab = torch.unique(torch.cat([base_vocab] + [lab[v] for lab, v in zip(labels, valid)]))
    lookup = torch.full((vocab_size,), -1, dtype=torch.long)
    lookup[vocab] = torch.arange(len(vocab))
    return vocab, [torch.where(v, lookup[lab], torch.zeros_like(lab)) for lab, v in zip(labels, valid)]


def concat_groups(batches: list) -> dict:
    out = {}
    for key in batches[0]:
        if key == "history":
            continue
        out[key] = torch.cat([b[key] for b in batches], 0)
    return out


def model_forward(model, b, vocab: Optional[torch.Tensor] = None):
    """Logits [B, K, V] (or [B, K, |vocab|] over the token subset ``vocab``: the frozen LM head's
    rows for those tokens only -- the training-time vocabulary subset, see ``--vocab-subset``)."""
    if vocab is not None and model.config.head_input == "hidden":
        z = model.backbone(b["context_hidden"], b["context_valid"], b["anchor_ids"], b.get("history"), b["round_offset"])
        y = model.head(z[:, :-1], z[:, 1:])
        return torch.nn.functional.linear(model.final_norm(y), model.lm_head_weight[vocab].to(y.dtype))
    return model(b["context_hidden"], b["context_valid"], b["anchor_ids"], history=b.get("history"),
                 round_offset=b["round_offset"], feedback_tokens=b["labels"] if model.config.head_input == "token" else None)


@torch.no_grad()
def greedy_scores(model: DLiteDrafter, data: FeatureData, groups, autocast, chunk: int = 8):
    """Per held-out anchor: the committed tokens of a greedy round there (1 + leading drafts equal
    to the target's greedy tokens; the data is greedy-regenerated, so labels are the target's
    continuation), and per draft position the accuracy. Returns (tau [N], acc per position).
    History-free drafters run ``chunk`` sequences' anchors per forward, others one sequence."""
    cfg = model.config
    C, K = cfg.num_context_positions, cfg.block_size
    hist = _hist_mode(cfg)
    taus, hits, n_valid = [], torch.zeros(K), torch.zeros(K)
    step = chunk if hist == 0 else 1
    for i in range(0, len(groups), step):
        gs = [data.group(si, a, C, K, hist, False) for si, a in groups[i:i + step]]
        b = concat_groups(gs) if hist == 0 else gs[0]  # a history is per sequence
        with autocast():
            draft = model_forward(model, b).float().argmax(-1)
        taus.append(greedy_accept_length(draft, b["labels"], b["valid"]))
        hits += ((draft == b["labels"]) & b["valid"]).float().sum(0)
        n_valid += b["valid"].float().sum(0)
    return torch.cat(taus), (hits / n_valid.clamp(min=1)).tolist()


def evaluate(model: DLiteDrafter, data: FeatureData, groups, autocast) -> dict:
    """Expected greedy tau on held-out anchors and per-position accuracy (``greedy_scores``)."""
    model.eval()
    tau, acc = greedy_scores(model, data, groups, autocast)
    model.train()
    half = 1.96 * float(tau.std()) / math.sqrt(len(tau)) if len(tau) > 1 else 0.0
    m = float(tau.mean())
    return {"tau_proxy": m, "tau_ci95": [round(m - half, 4), round(m + half, 4)], "acc_per_pos": [round(x, 4) for x in acc],
            "eval_anchors": int(len(tau))}


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
    offset, last_stage, g = 0, None, 0
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
            from .model_card import training_record, write_training_json
            from .recipe import summarize

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


def make_engine_eval(target, tokenizer, workloads: list, max_convs: int, max_new_tokens: int):
    """Held-out tau through the reference engine (exact rounds) on a small workload sample:
    ``workloads`` e.g. ["sharegpt-heldout", "agent-stdlib"]; run at the end of every stage."""
    from ..drafters import DLiteEngineDrafter
    from ..engine import ReferenceEngine
    from ..workloads import load_workload
    from ..workloads.replay import eos_token_ids, evaluate_tau

    convs = {w: load_workload(w, max_convs=max_convs) for w in workloads}

    def fn(model, stage, step):
        model.eval()
        out = {}
        eng = ReferenceEngine(target, DLiteEngineDrafter(model), eos_token_ids=eos_token_ids(tokenizer, target))
        try:
            for w, cv in convs.items():
                r = evaluate_tau(eng, cv, max_new_tokens, tokenizer)
                out[f"engine_tau/{w}"] = round(float(r["tau"]), 3)
        except Exception as exc:  # noqa: BLE001 - an eval failure must not lose the training run
            out["engine_eval_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            eng.close()
            model.train()
        print(f"train[{stage}] step {step}: reference-engine tau {out}")
        return out

    return fn


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
