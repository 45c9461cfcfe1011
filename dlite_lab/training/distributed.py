"""Where training runs: the device and, under ``torchrun``, the process group.

``sglang-dlite train`` is one process by default. Launched by ``torchrun`` (the env has
``WORLD_SIZE`` > 1, ``RANK``, ``LOCAL_RANK``), every process joins one process group (NCCL on
GPUs, gloo on the CPU), trains a ``DistributedDataParallel`` copy of the drafter, and takes its
own slice of every **global** batch (``rank_slice``): the global batch of a step is drawn once,
identically on every rank, from a generator whose state does not depend on the world size, so
ranks never see the same anchors and a checkpoint resumes under any world size.

Batch size: ``--batch-size`` and ``--seqs-per-batch`` are **per process**; one optimizer step
uses ``WORLD_SIZE x`` as many anchors (the same step as one process with the multiplied values).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sglang_dlite.errors import DLiteConfigError

DEVICES = ("auto", "cuda", "cpu")


@dataclass
class DistState:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this module initialized the process group (and destroys it)


STATE = DistState()


def resolve_device(name: Optional[str], flag: str = "--device") -> torch.device:
    """``auto``/None: CUDA when torch sees a GPU, else the CPU. ``cuda`` without a GPU is refused
    (``flag``: the option the messages name)."""
    name = (name or "auto").lower()
    if name not in DEVICES and not name.startswith("cuda:"):
        raise DLiteConfigError(f"{flag} must be one of {', '.join(DEVICES)} (or cuda:N), not {name!r}.")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DLiteConfigError(f"{flag} {name}: torch {torch.__version__} sees no CUDA device here; "
                               f"use {flag} cpu (or install a CUDA build of torch on a GPU machine).")
    return torch.device(name)


def torchrun_env() -> Optional[dict]:
    """{rank, world, local_rank} when this process was launched by torchrun with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    try:
        return {"rank": int(os.environ["RANK"]), "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}
    except KeyError as exc:
        raise DLiteConfigError(f"WORLD_SIZE={world} is set but {exc.args[0]} is not: launch with "
                               "`torchrun --nproc-per-node N -m sglang_dlite train ...`.") from None


def setup(device: Optional[str] = "auto") -> DistState:
    """Resolve the device; under torchrun, join the process group (NCCL on CUDA, gloo on the CPU)
    and bind this process to GPU ``LOCAL_RANK``. Idempotent; returns the state."""
    dev = resolve_device(device)
    env = torchrun_env()
    if env is None:
        STATE.rank, STATE.world, STATE.local_rank = 0, 1, 0
        STATE.device = dev
        return STATE
    if dev.type == "cuda":
        if env["local_rank"] >= torch.cuda.device_count():
            raise DLiteConfigError(f"LOCAL_RANK {env['local_rank']} but this node has {torch.cuda.device_count()} "
                                   "GPUs: --nproc-per-node must not exceed the GPUs per node.")
        dev = torch.device("cuda", env["local_rank"])
        torch.cuda.set_device(dev)
    if not torch.distributed.is_initialized():
        # a stage end waits for rank 0's evaluation/export: allow more than NCCL's 10-minute default
        minutes = float(os.environ.get("SGLANG_DLITE_DIST_TIMEOUT_MIN", "60"))
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                             timeout=datetime.timedelta(minutes=minutes))
        STATE.owns_group = True
    STATE.rank, STATE.world, STATE.local_rank = env["rank"], env["world"], env["local_rank"]
    STATE.device = dev
    return STATE


def shutdown() -> None:
    if STATE.owns_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    STATE.owns_group = False
    STATE.rank, STATE.world, STATE.local_rank = 0, 1, 0


def is_main() -> bool:
    return STATE.rank == 0


def barrier() -> None:
    if STATE.world > 1:
        if STATE.device.type == "cuda":
            torch.distributed.barrier(device_ids=[STATE.device.index or 0])
        else:
            torch.distributed.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the ranks (no-op in one process); ``op``: sum | min | max."""
    if STATE.world > 1:
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op.upper()))
    return t


def reduce_scalars(values, op: str = "sum") -> list:
    """Python floats reduced over the ranks (one collective for all of them)."""
    if STATE.world == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=STATE.device)
    return all_reduce(t, op).tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any (a decision every rank must take together)."""
    return bool(reduce_scalars([1.0 if flag else 0.0], "max")[0])


def rank_slice(items: list, rank: Optional[int] = None, world: Optional[int] = None) -> list:
    """Rank ``rank``'s contiguous share of a global batch of ``world * n`` items: disjoint across
    ranks, together the whole batch in order (one process: all of it)."""
    rank = STATE.rank if rank is None else rank
    world = STATE.world if world is None else world
    if len(items) % world:
        raise DLiteConfigError(f"a global batch of {len(items)} groups cannot be split evenly over {world} processes.")
    n = len(items) // world
    return list(items[rank * n:(rank + 1) * n])


def union_mask(mask: torch.Tensor) -> torch.Tensor:
    """Element-wise OR of a uint8 membership mask over the ranks (the global batch's vocabulary)."""
    if STATE.world == 1:
        return mask
    t = mask.to(STATE.device, torch.uint8)
    return all_reduce(t, "max").to(mask.device)


def wrap(module: torch.nn.Module, ignore: tuple = ()) -> torch.nn.Module:
    """``DistributedDataParallel`` around ``module`` under torchrun (itself in one process).
    ``ignore``: names of parameters/buffers that are identical on every rank and never trained
    (the target's frozen embedding and LM head): neither broadcast nor reduced."""
    if STATE.world == 1:
        return module
    names = [n for n, _ in list(module.named_parameters()) + list(module.named_buffers()) if n.split(".")[-1] in ignore]
    DDP._set_params_and_buffers_to_ignore_for_model(module, names)
    kw = {"device_ids": [STATE.device.index or 0]} if STATE.device.type == "cuda" else {}
    return DDP(module, broadcast_buffers=False, **kw)
