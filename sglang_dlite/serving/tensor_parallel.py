"""Tensor parallelism for the DLITE worker: the target's vocabulary-sharded embedding / LM head
gathered once into full copies (padding stripped, checked against the sharded embedding), and
per-round tensors made identical on every TP rank (broadcast from rank 0, optionally checked); the
target's embedding / LM head found on an sglang model, and what the drafter costs in memory per rank."""

from __future__ import annotations

import torch
from sglang.srt.distributed import get_tp_group

from sglang_dlite.errors import DLiteConfigError


def tp_group(model_runner):
    """sglang's TP group coordinator when the target runs tensor-parallel, else None."""
    group = get_tp_group()
    return group if group.world_size > 1 else None


def gather_vocab_rows(weight: torch.Tensor, vocab: int, group) -> torch.Tensor:
    """A full [vocab, H] copy of a target embedding / LM head weight.

    Under TP sglang's VocabParallelEmbedding / ParallelLMHead hold rows
    [rank * n, (rank + 1) * n) of the vocabulary padded to tp * n rows: the shards are gathered in
    rank order and the padding stripped. Without TP (all rows local) this is the unpadded view."""
    if group is None:
        return weight[:vocab]
    parts = [torch.empty_like(weight) for _ in range(group.world_size)]
    torch.distributed.all_gather(parts, weight.contiguous(), group=group.device_group)
    full = torch.cat(parts, dim=0)
    if full.shape[0] < vocab:
        raise DLiteConfigError(
            f"DLITE: the target's vocabulary-sharded weight gathers to {full.shape[0]} rows over "
            f"{group.world_size} TP ranks, fewer than the vocabulary ({vocab}).")
    return full[:vocab].contiguous()


def check_gathered_embedding(embed_module, full: torch.Tensor) -> None:
    """The gathered embedding copy must equal what the target's own (sharded) embedding returns
    for tokens of every shard: a wrong shard layout would silently ruin every draft."""
    V = full.shape[0]
    ids = torch.unique(torch.cat([torch.arange(0, V, max(1, V // 61)), torch.tensor([V - 1])]))
    ids = ids.to(device=full.device)
    got = embed_module(ids)
    if not torch.equal(got.to(full.dtype), full[ids]):
        raise DLiteConfigError(
            "DLITE: the embedding gathered from the TP ranks does not match the target's sharded "
            "embedding (an unexpected vocabulary shard layout); serve DLITE with --tp-size 1.")


def same_on_all_ranks(group, t: torch.Tensor, what: str, *, sync: bool, check: bool) -> torch.Tensor:
    """Under TP (``group`` not None): make t identical on every rank -- broadcast from TP rank 0
    when ``sync`` (the debug setting ``tp_sync``, on by default), after checking that the ranks computed
    the same when ``check`` (``tp_check``: a difference raises, naming the ranks)."""
    if group is None or not (sync or check):
        return t
    t = t.contiguous()
    if check:
        parts = [torch.empty_like(t) for _ in range(group.world_size)]
        torch.distributed.all_gather(parts, t, group=group.device_group)
        bad = [r for r, p in enumerate(parts) if not torch.equal(p, parts[0])]
        if bad:
            raise RuntimeError(f"DLITE: {what} differ between TP rank 0 and ranks {bad} "
                               f"(rank 0: {parts[0].tolist()}, rank {bad[0]}: {parts[bad[0]].tolist()}).")
    if sync:
        group.broadcast(t, src=0)
    return t


def target_parts(model):
    """(embedding weight, LM head weight) of an sglang causal LM."""
    inner = getattr(model, "model", model)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None or not hasattr(embed, "weight"):
        raise DLiteConfigError(f"DLITE: {type(model).__name__} exposes no model.embed_tokens.weight.")
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise DLiteConfigError(f"DLITE: {type(model).__name__} exposes no lm_head.weight.")
    return embed.weight, lm_head.weight


def drafter_memory(drafter, group, target_weights, embed_full: torch.Tensor, head_full: torch.Tensor) -> dict:
    """MiB this rank spends on the drafter: its own weights (the target's tensors it shares not
    counted) and, under TP (``group`` not None), the gathered full embedding / LM head copies."""
    mib = 2 ** 20
    shared = {w.data_ptr() for w in (*target_weights, embed_full, head_full)}
    own = sum(t.numel() * t.element_size() for t in list(drafter.parameters()) + list(drafter.buffers())
              if t.data_ptr() not in shared)
    copies = 0 if group is None else embed_full.numel() * embed_full.element_size() * (
        1 if head_full is embed_full else 2)
    return {"tp_rank": 0 if group is None else int(group.rank_in_group), "drafter_weights_mib": round(own / mib, 1),
            "gathered_vocab_copies_mib": round(copies / mib, 1)}
