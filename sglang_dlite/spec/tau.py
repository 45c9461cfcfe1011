"""τ, the acceptance length: committed tokens per verify round, the prefill excluded.

A verify round of a chain drafter commits ``accepted + 1`` tokens (the accepted drafts and the
target's bonus token). The prefill commits the first token without a verify round and is not
counted: generating ``n`` tokens in ``r`` rounds gives τ = (n - 1) / r. τ = 1 means speculation
did nothing (one token per target forward, like plain decoding).
"""

from __future__ import annotations

from typing import Iterable


def tau_of_rounds(accepted_per_round: Iterable[int]) -> float:
    """τ of one request from its rounds' accepted draft counts (bonus not included)."""
    acc = list(accepted_per_round)
    return sum(a + 1 for a in acc) / len(acc) if acc else 0.0


def mean_tau(output_tokens: int, requests: int, rounds: int) -> float | None:
    """τ over many requests from totals: (output tokens - one prefill token per request) / rounds."""
    if rounds <= 0:
        return None
    return (output_tokens - requests) / rounds
