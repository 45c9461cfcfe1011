"""The reference engine stops at the first committed EOS, also when a verify round accepts it in
the middle of its drafts: the output ends with it and no further round runs (as greedy decoding)."""

from __future__ import annotations

import pytest

from dlite_lab.benchmarking.random_models import tiny_llama
from dlite_lab.reference.drafters import OracleDrafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.drafting.tau import committed_per_round

K = 5  # drafts per round
PROMPT = [1, 7, 8, 9]


@pytest.fixture(scope="module")
def varied_target():
    """An untied tiny Llama: its greedy stream varies (the tied one repeats the prompt's last token)."""
    return tiny_llama(0, tied=False, max_positions=512)


def test_eos_accepted_mid_round_stops_generation(varied_target):
    stream = ReferenceEngine(varied_target).generate(PROMPT, 20).output_ids  # no EOS
    # p: a draft of the first round (drafts stream[1..K], bonus stream[K + 1]) with drafts after it,
    # its token new to the stream, so that the target's own greedy output ends there.
    p = next(p for p in range(2, K) if stream[p] not in stream[:p])
    eos = stream[p]
    plain = ReferenceEngine(varied_target, eos_token_ids=(eos,)).generate(PROMPT, 20)
    assert plain.output_ids == stream[:p + 1]

    eng = ReferenceEngine(varied_target, OracleDrafter({tuple(PROMPT + stream): None}, K), (eos,))
    sess = eng.new_session()
    res = eng.generate(PROMPT, 20, session=sess)
    assert res.output_ids == stream[:p + 1]
    # One round accepting the whole block; the tokens past EOS are dropped and not counted.
    assert len(res.rounds) == 1 and res.rounds[0].accepted == K
    assert committed_per_round([r.accepted for r in res.rounds], len(res.output_ids)) == [p]
    assert res.tau == pytest.approx(p)  # p + 1 output tokens, the prefill's excluded, in 1 round
    assert sess.tokens == PROMPT + res.output_ids and sess.cache_len == len(sess.tokens) - 1
    eng.close()
