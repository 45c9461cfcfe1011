"""Stage checkpoints (``OUT/<stage>/ckpt.pt``) and the run's metrics log / curve.

A checkpoint holds no device: tensors are saved on the CPU and loaded with ``map_location="cpu"``
(the optimizer moves its state to its parameters' device), so a run started on a GPU resumes on
the CPU and back. Its data position is in world-size-independent terms (the global batch
generator's state, or the shard stream's state, plus the global step), so a run resumes under
another number of ``torchrun`` processes.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from dlite_lab.training.data import DataError
from dlite_lab.training.options import STAGES


def to_cpu(obj):
    """A copy of a (nested) state dict with every tensor on the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_checkpoint(path: str, state: dict) -> None:
    """Atomically write ``state`` (tensors moved to the CPU)."""
    tmp = path + ".tmp"
    torch.save(to_cpu(state), tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a corrupt checkpoint: say so
        raise DataError(f"checkpoint {path!r} is unreadable ({exc}); delete it to restart the stage.") from exc


def log_metrics(out_dir: str, rec: dict) -> None:
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_metrics(out_dir: str) -> list:
    """The records ``log_metrics`` appended to the run's metrics.jsonl ([] before the first)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def plot_curves(out_dir: str, stages=STAGES) -> Optional[str]:
    recs = read_metrics(out_dir)
    if not recs:
        return None
    try:
        import matplotlib  # optional: the dev extra (no plot without it)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for st in stages:
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
