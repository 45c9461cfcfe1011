"""Where two greedy outputs part, and whether it is a precision tie. Pure torch + transformers.

Speculative decoding is lossless: the verify pass decides every token with the target's own
logits. In float32 that makes DLITE's greedy output equal to no speculation token for token (the
tests assert it). In bfloat16 it does not, for a reason that has nothing to do with the drafter:
a verify pass computes a token's logits inside a W-token GEMM, a decode step inside a 1-token
GEMM, and the two round differently; bf16 logits near 20 are 0.125 apart, so exact and near ties
fall either way. No speculation differs from itself between batch sizes for the same reason.

``classify_divergences`` finds the first differing position of every differing request and
re-scores it with the target in float32: if the two tokens' logits are within ``tie_margin``
there, the divergence is a precision tie; if the output's token is the one the float32 target
prefers (by more than the margin), the *baseline* left the exact greedy path there
(``baseline_off``: e.g. no speculation's own bf16 prefill in a larger batch), not the output;
otherwise it is a real mismatch (a bug): ``is_mismatch``.

The margin is measured, not guessed, where a ``noise`` function is given: ``Fp32LogitGap.bf16_noise``
runs the same prefix through the target in bfloat16 and returns the largest change bf16 makes to the
float32 top-2 logit gap at any of its positions; a flip below that is within bf16's own error on
that very sequence. (SmolLM2-135M on a CPU with AMX, the demo's 5 requests, 3 150 positions: that
change has median 0.07, p99 0.30, max 0.72, so a fixed 0.25 called bf16 noise a mismatch.)
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Callable, Optional

import torch

from dlite_lab.workloads.replay import first_divergence, tokens_at

# float32 logit gap under which a differing bf16 greedy token is a precision tie: two bf16 steps
# at |logit| ~ 20 (where bf16 values are 0.125 apart)
DEFAULT_TIE_MARGIN = 0.25

Score = Callable[[list, int, int], float]  # (prefix ids, token a, token b) -> logit a - logit b (float32)


def classify_divergences(prompts, outs, base_outs, score: Score, tie_margin: float,
                         noise: Optional[Callable[[list], float]] = None) -> list[dict]:
    """One record per request whose output (``outs``) differs from the baseline's: the position,
    both tokens, the float32 logit gap |a - b| between them there, ``tie`` (gap < the margin) and
    ``baseline_off`` (not a tie, and the float32 target prefers the output's token). Where one
    output stopped and the other went on, there is no second token: neither. The margin is
    ``tie_margin``, or ``noise(prefix)`` where that is larger (``bf16_noise`` in the record): the
    low-precision error measured on the sequence up to the divergence."""
    if not len(prompts) == len(outs) == len(base_outs):
        raise ValueError(f"{len(prompts)} prompts, {len(outs)} outputs, {len(base_outs)} baseline outputs")
    records = []
    for i, (p, a, b) in enumerate(zip(prompts, outs, base_outs)):
        n = first_divergence(a, b)
        if n is None:
            continue
        ta, tb = tokens_at(n, a, b)
        diff = None if ta is None or tb is None else float(score(list(p) + list(a[:n]), ta, tb))
        gap = None if diff is None else abs(diff)
        measured = None if noise is None or gap is None else float(noise(list(p) + list(a[:n])))
        tie = gap is not None and gap < max(tie_margin, measured or 0.0)
        rec = {"request": i, "position": n, "token": ta, "baseline_token": tb,
               "fp32_logit_gap": None if gap is None else round(gap, 4), "tie": tie,
               "baseline_off": diff is not None and not tie and diff > 0}
        if measured is not None:
            rec["bf16_noise"] = round(measured, 4)
        records.append(rec)
    return records


def is_mismatch(record: dict) -> bool:
    """A divergence the output is to blame for: not a precision tie, and the float32 target does
    not prefer the output's token over the baseline's."""
    return not record["tie"] and not record.get("baseline_off", False)


class Fp32LogitGap:
    """``score`` for ``classify_divergences``: the HF target in float32.

    Scored in a child process (started on first use, one JSON line per query): loading a HF model
    in a process that has run and shut down an sglang Engine makes multiprocessing's resource
    tracker print a spurious KeyError traceback at exit."""

    def __init__(self, target_path: str):
        self.target_path, self.proc = str(target_path), None
        self._answers = {}  # query -> answer: modes and levels often diverge on the same sequence

    def __call__(self, prefix: list, a: int, b: int) -> float:
        """logit a - logit b of the float32 target after ``prefix``."""
        return self._ask({"op": "gap", "prefix": list(map(int, prefix)), "a": int(a), "b": int(b)})

    def bf16_noise(self, prefix: list) -> float:
        """The largest |change| that running the target in bfloat16 makes to the float32 target's
        top-2 logit gap, over every position of ``prefix``: how far bf16 alone can move a choice
        between two tokens on this sequence (``noise`` for ``classify_divergences``)."""
        return self._ask({"op": "bf16_noise", "prefix": list(map(int, prefix))})

    def _ask(self, query: dict) -> float:
        key = json.dumps(query, sort_keys=True)
        if key not in self._answers:
            self._answers[key] = self._query(query)
        return self._answers[key]

    def _query(self, query: dict) -> float:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "dlite_lab.divergence", self.target_path],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps(query) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the float32 scorer for {self.target_path!r} exited (rc {self.proc.poll()})")
        return float(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def top2_gap_change(logits32, logits16):
    """Per position: |change| of the float32 top-2 logit gap when the logits come from bf16 instead
    ([T, V] each; the top-2 tokens are float32's)."""
    top2 = logits32.topk(2, dim=-1).indices
    g32, g16 = logits32.gather(-1, top2), logits16.float().gather(-1, top2)
    return ((g16[..., 0] - g16[..., 1]) - (g32[..., 0] - g32[..., 1])).abs()


def logit_gap_server(target_path: str, inp, out) -> None:
    """Read JSON queries, one per line, write one number per line: {"op": "gap", "prefix", "a", "b"}
    -> logit a - logit b of the float32 target; {"op": "bf16_noise", "prefix"} -> the largest
    ``top2_gap_change`` over the prefix's positions (the bf16 copy is made on first use)."""
    from transformers import AutoModelForCausalLM  # start-up cost: ~2 s; the CLI's demo imports this module

    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    model16 = None
    last = (None, None)  # (prefix, its float32 logits): classify_divergences asks gap, then bf16_noise, of one prefix
    for line in inp:
        q = json.loads(line)
        x = torch.tensor([q["prefix"]])
        with torch.no_grad():
            if last[0] != q["prefix"]:
                last = (q["prefix"], model(x).logits[0].float())
            logits32 = last[1]
            if q["op"] == "gap":
                value = float(logits32[-1, q["a"]] - logits32[-1, q["b"]])
            elif q["op"] == "bf16_noise":
                if model16 is None:
                    model16 = copy.deepcopy(model).to(torch.bfloat16)
                value = float(top2_gap_change(logits32, model16(x).logits[0]).max())
            else:
                raise ValueError(f"unknown query {q['op']!r}")
        out.write(f"{value!r}\n")
        out.flush()


if __name__ == "__main__":
    logit_gap_server(sys.argv[1], sys.stdin, sys.stdout)
