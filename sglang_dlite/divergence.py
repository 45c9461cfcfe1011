"""Where two greedy outputs part, and whether it is a precision tie. Pure torch + transformers.

Speculative decoding is lossless: the verify pass decides every token with the target's own
logits. In float32 that makes DLITE's greedy output equal to no speculation token for token (the
tests assert it). In bfloat16 it does not, for a reason that has nothing to do with the drafter:
a verify pass computes a token's logits inside a W-token GEMM, a decode step inside a 1-token
GEMM, and the two round differently; bf16 logits near 20 are 0.125 apart, so exact and near ties
fall either way. No speculation differs from itself between batch sizes for the same reason.

``classify_divergences`` finds the first differing position of every differing request and
re-scores it with the target in float32: if the two tokens' logits are within ``tie_margin``
there, the divergence is a precision tie; otherwise it is a real mismatch (a bug).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

Score = Callable[[list, int, int], float]  # (prefix ids, token a, token b) -> |logit a - logit b|


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token (None if equal; the shorter length if one output is a
    prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify_divergences(prompts, outs, base_outs, score: Score, tie_margin: float) -> list[dict]:
    """One record per request whose output (``outs``) differs from the baseline's: the position,
    both tokens, the float32 logit gap between them there, and ``tie`` (gap < tie_margin). Where
    one output stopped and the other went on, there is no second token: not a tie."""
    if not len(prompts) == len(outs) == len(base_outs):
        raise ValueError(f"{len(prompts)} prompts, {len(outs)} outputs, {len(base_outs)} baseline outputs")
    records = []
    for i, (p, a, b) in enumerate(zip(prompts, outs, base_outs)):
        n = first_divergence(a, b)
        if n is None:
            continue
        ta = a[n] if n < len(a) else None
        tb = b[n] if n < len(b) else None
        gap = None if ta is None or tb is None else float(score(list(p) + list(a[:n]), ta, tb))
        records.append({"request": i, "position": n, "token": ta, "baseline_token": tb,
                        "fp32_logit_gap": None if gap is None else round(gap, 4),
                        "tie": gap is not None and gap < tie_margin})
    return records


class Fp32LogitGap:
    """``score`` for ``classify_divergences``: the HF target in float32 (loaded on first use)."""

    def __init__(self, target_path: str):
        self.target_path, self.model = str(target_path), None

    def __call__(self, prefix: list, a: int, b: int) -> float:
        import torch

        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.target_path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = self.model(torch.tensor([prefix])).logits[0, -1].float()
        return abs(float(logits[a] - logits[b]))
