"""τ, the acceptance length: committed tokens per verify round, the prefill's token excluded.

The one convention of this project, computed here and nowhere else (every engine figure, bench
JSON, table and demo line goes through ``tau``; ``python_tests/drafting/test_tau.py`` checks that no other
module of ``sglang_dlite/`` or ``bench/`` divides its own)::

    τ = committed tokens / verify rounds = (output tokens - one per request) / verify rounds

- A verify round of a chain drafter commits ``accepted + 1`` tokens: the accepted drafts and the
  target's bonus (or correction) token. A round that verifies no draft commits 1.
- The prefill commits a request's first output token without a verify round: that token is not
  counted, and the prefill is not a round. τ = 1 means speculation did nothing (one token per
  target forward, like plain decoding); τ = K + 1 is every draft of a K-draft chain accepted.
- Only the tokens a request returns count: the round that crosses the request's stop (EOS, the
  token limit) is a round, but the tokens it computed past the stop were dropped from the output
  and are not counted (``committed_per_round``).
- No verify round (no speculation, or the prefill's token was the last one): τ is undefined and
  every function here returns None.

sglang (``meta_info`` of a finished request; ``tau_of_sglang``): ``completion_tokens`` is the
request's output through its stop (``Req.output_ids_through_stop``) and includes the prefill's
token (``process_batch_result_prefill`` appends it); ``spec_verify_ct`` is incremented once per
decode verify of the request (``_resolve_spec_v2_tokens``), never by the prefill / extend, the last
round included (its tokens past the stop are cut from ``completion_tokens``), and not for an
overlap-scheduler round run after the request had finished. So τ = (completion_tokens - 1) /
spec_verify_ct per request, and over a batch the sums. sglang's own ``meta_info``
``spec_accept_length`` (``completion_tokens / spec_verify_ct``) counts the prefill's token, so it
exceeds τ by 1 / spec_verify_ct per request; its ``/metrics`` gauge ``sglang:spec_accept_length``
(the decode rounds' accepted drafts + bonus tokens / request-rounds, per logging interval) leaves
the prefill out but counts the tokens computed past a stop. The project reports those two only
under sglang's name, never as τ.
A request retracted under memory pressure is prefilled again, which commits one more token
without a verify round (rare; not corrected).

Held-out τ (training evaluation, ``bench/heldout_tau.py``): every held-out anchor is scored as one
greedy verify round there (committed = 1 + the leading drafts equal to the target's tokens, no
prefill), so τ = ``tau_of_committed`` of the anchors' committed counts.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

# recorded with every τ this project writes (bench JSONs), printed beside it (demo)
TAU_DEFINITION = "committed tokens per verify round, the prefill's token excluded"


def tau(committed_tokens: float, verify_rounds: int) -> Optional[float]:
    """τ = tokens committed by verify rounds / verify rounds (None without a round): the formula."""
    if verify_rounds <= 0:
        return None
    return float(committed_tokens) / verify_rounds


def committed_per_round(accepted_per_round: Iterable[int], output_tokens: Optional[int] = None) -> list:
    """Tokens each verify round committed: ``accepted + 1``. With ``output_tokens`` (the request's
    returned output, the prefill's token included), the rounds' tokens past the returned output
    (computed beyond its EOS / token limit, then dropped) are not counted."""
    out = [int(a) + 1 for a in accepted_per_round]
    if output_tokens is not None:
        room = max(int(output_tokens) - 1, 0)
        for i, c in enumerate(out):
            out[i] = min(c, room)
            room -= out[i]
    return out


def tau_of_rounds(accepted_per_round: Iterable[int], output_tokens: Optional[int] = None) -> Optional[float]:
    """τ from the rounds' accepted draft counts (bonus not included); ``output_tokens`` as in
    ``committed_per_round``."""
    return tau_of_committed(committed_per_round(accepted_per_round, output_tokens))


def tau_of_committed(committed_per_round) -> Optional[float]:
    """τ from the rounds' committed token counts (``accepted + 1`` each), a list or a 1-d tensor /
    array: e.g. held-out anchors, each scored as one greedy round."""
    total = committed_per_round.sum() if hasattr(committed_per_round, "sum") else sum(committed_per_round)
    return tau(float(total), len(committed_per_round))


def tau_of_requests(requests: Iterable[Tuple[int, int]]) -> Optional[float]:
    """τ over requests given as ``(output tokens incl. the prefill's, verify rounds)`` each."""
    committed = rounds = 0
    for n_out, n_rounds in requests:
        committed += max(int(n_out) - 1, 0)
        rounds += int(n_rounds)
    return tau(committed, rounds)


def tau_of_sglang(meta_infos: Iterable[dict]) -> Optional[float]:
    """τ over sglang requests from their ``meta_info`` (``completion_tokens``, ``spec_verify_ct``;
    the latter absent without speculation)."""
    return tau_of_requests((int(m.get("completion_tokens") or 0), int(m.get("spec_verify_ct") or 0))
                           for m in meta_infos)


def pool_tau(parts: Iterable[Tuple[Optional[float], int]]) -> Optional[float]:
    """τ of several measurements pooled, from each one's ``(τ, verify rounds)``: the rounds-weighted
    mean, i.e. their committed tokens over their rounds (a part with no τ or no rounds is left out)."""
    committed = rounds = 0
    for t, n in parts:
        if t is not None and n:
            committed += t * n
            rounds += n
    return tau(committed, rounds)
