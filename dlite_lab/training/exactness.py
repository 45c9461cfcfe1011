"""Exactness of regenerated text against the float32 target: its greedy choice at every position
(one teacher-forced HF pass, which also gives the features), the first / number of generated tokens
that leave it, and the cut rule (``relabel``: a sequence is cut where its text leaves the target's
greedy choice). Used by every regeneration engine and by bench/gen_throughput.py."""

from __future__ import annotations

from typing import Optional

import torch

from dlite_lab.training.features import padded_forward_groups


@torch.no_grad()
def reference_greedy(model, seqs, layer_ids=None, batch_tokens: int = 4096):
    """One float32 HF forward per group of sequences (teacher-forced): per sequence, the target's
    greedy next token at every position ([len] int64; entry j = argmax after seq[:j+1]) and, with
    ``layer_ids``, its features [len, L+1, H] fp16."""
    preds, feats = [None] * len(seqs), [None] * len(seqs)
    for group, st, logits in padded_forward_groups(model, seqs, layer_ids, batch_tokens, logits=True):
        am = logits.argmax(-1).cpu()
        for r, g in enumerate(group):
            preds[g] = am[r, :len(seqs[g])]
            if st is not None:
                feats[g] = st[r, :len(seqs[g])]
    return preds, feats


def _off_greedy(seq, mask, pred) -> torch.Tensor:
    """[len - 1] bool: entry j - 1 says generated token j (mask[j] == 1) is not pred[j - 1]."""
    s = torch.as_tensor(seq[1:], dtype=torch.long)
    return (s != pred[:-1].to(torch.long)) & torch.as_tensor(mask[1:], dtype=torch.bool)


def first_disagreement(seq, mask, pred) -> Optional[int]:
    """Index j of the first generated token (mask[j] == 1) that is not the target's greedy choice
    after seq[:j] (pred[j - 1]); None if every generated token is."""
    nz = torch.nonzero(_off_greedy(seq, mask, pred))
    return int(nz[0, 0]) + 1 if len(nz) else None


def count_disagreements(seq, mask, pred) -> int:
    return int(_off_greedy(seq, mask, pred).sum())


def relabel(model, seqs, masks, layer_ids=None, cut: bool = True):
    """One float32 target pass over finished sequences (``reference_greedy``): counts the generated
    tokens that are not the target's greedy choice and, with ``cut`` (the cut rule), cuts a sequence
    whose generated text leaves it at position j there: seq[:j] + [the target's choice] (later text,
    conditioned on the other token, is dropped). Returns (seqs, masks, feats [len - 1, L+1, H] each
    or None without ``layer_ids``, counts: ``tokens_not_fp32_greedy``, with ``cut`` also
    ``sequences_cut`` and ``generated_tokens_dropped``)."""
    preds, feats = reference_greedy(model, seqs, layer_ids)
    counts = {"tokens_not_fp32_greedy": int(sum(count_disagreements(s, m, p) for s, m, p in zip(seqs, masks, preds)))}
    if cut:
        counts.update(sequences_cut=0, generated_tokens_dropped=0)
    out_s, out_m, out_f = [], [], []
    for s, m, p, f in zip(seqs, masks, preds, feats):
        j = first_disagreement(s, m, p) if cut else None
        if j is not None:
            counts["sequences_cut"] += 1
            counts["generated_tokens_dropped"] += int(sum(m[j:])) - 1
            s = list(s[:j]) + [int(p[j - 1])]
            m = list(m[:j]) + [1]
        out_s.append(list(s))
        out_m.append(list(m))
        out_f.append(None if f is None else f[: len(s) - 1])
    return out_s, out_m, out_f, counts
