"""Weight averaging of DLite drafters of one lineage (checkpoint averaging, a "model soup").

A drafter fine-tuned from another (v8 -> v9 on new data -> v10 on more of it, each with
``--init-from-drafter``) stays in the first one's basin of the loss, and the average of their
weights often generalizes better than any one of them (Wortsman et al., 2022, "Model soups"; the
shipped drafter is such an average, CHANGELOG.md).

Only drafters that are the same function of their weights can be averaged: the same config (K, C,
layers, rank, head, captured target layers, target shape) and the same drafting vocabulary. The
average is taken in float32 and saved in the first checkpoint's float dtype; integer buffers
(the drafting vocabulary's token ids) are copied. ``training.json`` records every source's own
record and the weights, and the model card renders them.

    sglang-dlite average-drafters --out DEST CKPT_A CKPT_B [CKPT_C ...] [--weights 1 1 2]
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from sglang_dlite.errors import DLiteInputError
from sglang_dlite.model.dlite import DLiteDrafter, load_checkpoint
from dlite_lab.training.model_card import render_average_card
from dlite_lab.training.run_summary import read_training_json, write_training_json

# config fields that say nothing about the function the weights compute
_CONFIG_NOISE = ("transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype")


def _config_dict(config) -> dict:
    d = config.to_dict()
    return {k: v for k, v in d.items() if k not in _CONFIG_NOISE}


def check_same_drafter(configs: Sequence, states: Sequence[dict], paths: Sequence[str]) -> None:
    """Raise DLiteInputError, naming the first difference, unless every checkpoint is the same
    drafter function of its weights (config, tensor names and shapes, drafting vocabulary)."""
    ref_cfg, ref_state, ref_path = _config_dict(configs[0]), states[0], paths[0]
    for cfg, state, path in zip(configs[1:], states[1:], paths[1:]):
        c = _config_dict(cfg)
        diff = sorted(k for k in set(c) | set(ref_cfg) if c.get(k) != ref_cfg.get(k))
        if diff:
            k = diff[0]
            raise DLiteInputError(
                f"cannot average {ref_path!r} with {path!r}: their configs differ in {', '.join(diff)} "
                f"({k}: {ref_cfg.get(k)!r} vs {c.get(k)!r}); only drafters of one architecture and target average.")
        if set(state) != set(ref_state):
            odd = sorted(set(state) ^ set(ref_state))
            raise DLiteInputError(f"cannot average {ref_path!r} with {path!r}: their tensors differ ({odd[:5]}).")
        for k, v in state.items():
            r = ref_state[k]
            if v.shape != r.shape:
                raise DLiteInputError(f"cannot average {ref_path!r} with {path!r}: tensor {k} has shape "
                                      f"{tuple(r.shape)} vs {tuple(v.shape)}.")
            if not v.is_floating_point() and not torch.equal(v, r):
                what = "drafting vocabulary" if k == "draft_vocab" else f"integer tensor {k}"
                raise DLiteInputError(
                    f"cannot average {ref_path!r} with {path!r}: their {what} differs; give them one "
                    "(`sglang-dlite draft-vocab --drafter CKPT --data DATA`, or export them with the same ids) first.")


def normalized_weights(n: int, weights: Optional[Sequence[float]]) -> list:
    if n < 2:
        raise DLiteInputError(f"averaging needs at least 2 drafters, got {n}.")
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise DLiteInputError(f"--weights has {len(weights)} values for {n} drafters.")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise DLiteInputError(f"--weights must be non-negative with a positive sum, got {list(weights)}.")
    s = float(sum(weights))
    return [float(w) / s for w in weights]


def average_states(states: Sequence[dict], weights: Sequence[float]) -> dict:
    """sum_i w_i * state_i in float32 for floating tensors; integer tensors from the first state."""
    out = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            acc = torch.zeros(v.shape, dtype=torch.float32)
            for w, st in zip(weights, states):
                acc.add_(st[k].float(), alpha=w)
            out[k] = acc
        else:
            out[k] = v.clone()
    return out


def average_drafters(paths: Sequence[str], weights: Optional[Sequence[float]] = None):
    """(DLiteDrafter holding the weighted average in float32, weights used, float dtype of the first file)."""
    ws = normalized_weights(len(paths), weights)
    loaded = [load_checkpoint(p) for p in paths]
    configs, states = [c for c, _ in loaded], [s for _, s in loaded]
    check_same_drafter(configs, states, paths)
    dtype = next((v.dtype for v in states[0].values() if v.is_floating_point()), torch.float32)
    model = DLiteDrafter.from_config_and_state(configs[0], average_states(states, ws), source=paths[0])
    return model, ws, dtype


def training_record(paths: Sequence[str], weights: Sequence[float]) -> dict:
    """``training.json`` of an average: every source's own record (None where it has none)."""
    return {"format": 1, "average": {"method": "weighted" if len(set(weights)) > 1 else "uniform",
                                     "sources": [{"path": p, "weight": round(w, 6), "training": read_training_json(p)}
                                                 for p, w in zip(paths, weights)]}}


def add_arguments(p) -> None:
    p.add_argument("drafters", nargs="*", metavar="CKPT", help="DLite checkpoint folders of one architecture")
    p.add_argument("--out", required=True, help="folder for the averaged checkpoint")
    p.add_argument("--weights", nargs="+", default=None, metavar="W",
                   help="one weight per checkpoint (normalized to sum 1; default: uniform); may stand before or "
                        "after the checkpoints")


def split_weights(drafters: Sequence[str], weights: Optional[Sequence[str]]) -> tuple:
    """(checkpoint folders, float weights or None) from the CLI: ``--weights`` takes every word after
    it, so in ``--weights 0.7 0.3 A B`` the folders A, B land in it; its leading numbers are the
    weights and the words after them are checkpoints, in command-line order after the positional ones."""
    if weights is None:
        return list(drafters), None
    ws, extra = [], []
    for w in weights:
        try:
            val = float(w)
        except ValueError:
            extra.append(w)
            continue
        if extra:
            raise DLiteInputError(f"--weights: the number {w!r} follows the checkpoint {extra[-1]!r}; give all weights "
                                  "together, one per checkpoint in the checkpoints' order.")
        ws.append(val)
    if not ws:
        raise DLiteInputError(f"--weights needs numbers, one per checkpoint; got {list(weights)}.")
    return list(drafters) + extra, ws


def run(args) -> int:
    args.drafters, args.weights = split_weights(args.drafters, args.weights)
    out = os.path.abspath(args.out)
    if any(os.path.abspath(p) == out for p in args.drafters):
        raise DLiteInputError(f"--out {args.out!r} is one of the checkpoints being averaged; write elsewhere.")
    model, ws, dtype = average_drafters(args.drafters, args.weights)
    model.save_pretrained(args.out, dtype=dtype)
    rec = training_record(args.drafters, ws)
    write_training_json(args.out, rec)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(render_average_card(model.config.to_dict(), rec))
    print(f"{args.out}: weighted average of {len(ws)} drafters ({', '.join(f'{w:.3f}' for w in ws)}), saved in {dtype}")
    return 0
