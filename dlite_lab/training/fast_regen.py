"""Fast greedy regeneration for ``gen-data --engine fast``: a pure-torch batched decode loop over a
HF Llama target (``fast_llama.FastLlama``: static KV cache, fp32 or bf16, MKL-packed weights).

* **Continuous batching**: every active conversation occupies one slot; a step runs all slots at
  their own positions (one GEMM per weight for the whole batch); a finished turn of a multi-turn
  conversation appends the next user turn to the *same* slot (only the new tokens are prefilled:
  earlier turns are never recomputed), a finished conversation's slot is refilled from the queue
  at once. Prompts are length-sorted within a window so that slots decode similar context lengths.
* **Features captured while generating** (outputs of the capture layers and of the final norm,
  fp16, the same layout as ``features.save_features``): no second target pass.

Exactness: the output is the target's greedy decoding, computed with other GEMM shapes than
HF's batch-1 forward, so a near-tie can round the other way; ``--relabel`` cuts such text at the
float32 target's own choice (``exactness.relabel``, whose features replace the captured ones), and
``bench/gen_throughput.py`` measures both.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from dlite_lab.reference.engine import accept_round
from dlite_lab.training.fast_llama import FastLlama
from dlite_lab.training.turns import Conversation, TurnRules, columns


class FastRegenerator:
    """Greedy turn-by-turn regeneration of conversations (the same sequences ``Regenerator``
    builds, by the same ``turns.TurnRules``), batched continuously."""

    def __init__(self, model, turns: TurnRules, capture_layers=None, batch_size=32, dtype=torch.float32,
                 sort_window=64, packed=True, attention="auto"):
        self.turns = turns
        self.capture = list(capture_layers) if capture_layers else []
        self.engine = FastLlama(model, batch_size, turns.max_len, dtype=dtype, capture_layers=self.capture,
                                packed=packed, attention=attention)
        self.batch_size, self.sort_window = batch_size, sort_window
        self.new_tokens = 0

    # ------------------------------------------------------------------ rows
    def _argmax(self, normed):
        lg = self.engine.logits(normed).float()
        top = torch.topk(lg, 2, dim=-1)
        return top.indices[..., 0], top.values[..., 0] - top.values[..., 1]

    def _extend(self, row: Conversation, slot: int, start: int):
        """Prefill the row's ids from ``start`` (first prompt or a new user turn) and push the
        target's first token. Its CPU time and tokens are counted apart (``prefill_cpu_s``,
        ``prefill_tokens``): decoding speed-ups cannot shorten it."""
        c0 = time.process_time()
        normed, f = self.engine.extend(slot, row.seq[start:], start, bool(self.capture))
        self.prefill_cpu_s = getattr(self, "prefill_cpu_s", 0.0) + time.process_time() - c0
        self.prefill_tokens = getattr(self, "prefill_tokens", 0) + len(row.seq) - start
        if f is not None:
            row.feats.append(f)
        tok, m = self._argmax(normed[None])
        self._push(row, int(tok[0]), float(m[0]))

    def _push(self, row: Conversation, tok: int, margin: float):
        self.turns.push(row, [tok], margin)
        self.new_tokens += 1

    def _next_turn(self, row: Conversation, slot: int) -> bool:
        """After a finished turn: append the next user turn to the slot (prefill only the new ids).
        Returns False if the conversation is over."""
        start = len(row.seq) - 1  # the turn's last token (EOS) has not been fed yet
        if not self.turns.next_turn(row):
            return False
        self._extend(row, slot, start)
        return True

    def _admit(self, row: Conversation, slot: int) -> bool:
        """Start a conversation in ``slot``; False if it is already over."""
        if not self.turns.begin(row):
            return False
        self._extend(row, slot, 0)
        return not self.turns.turn_over(row) or self._next_turn(row, slot)

    def _finish(self, row: Conversation):
        return self.turns.record(row)

    # ------------------------------------------------------------------ driver
    def stream(self, items: Iterable) -> Iterator[tuple]:
        """items: (key, conv) pairs. Yields (key, seq, mask, feats [len-1, L+1, H] fp16 or None,
        min top-1/top-2 logit margin of its generated tokens) as conversations finish."""
        it = iter(items)
        window: list = []

        def pull():
            if not window:
                for key, conv in it:
                    window.append(self.turns.open(key, conv))
                    if len(window) >= self.sort_window:
                        break
                window.sort(key=lambda r: -len(r.seq))  # pop() takes the shortest first
            return window.pop() if window else None

        rows: list = []  # rows[b] decodes in cache slot b
        while True:
            while len(rows) < self.batch_size:
                nxt = pull()
                if nxt is None:
                    break
                if self._admit(nxt, len(rows)):
                    rows.append(nxt)
                else:
                    yield self._finish(nxt)
            if not rows:
                return
            done = self._step(rows)
            for b in reversed(done):  # compact: the last row moves into the freed slot
                yield self._finish(rows[b])
                last = len(rows) - 1
                if b != last:
                    self.engine.move_slot(last, b, len(rows[last].seq) - 1)
                    rows[b] = rows[last]
                rows.pop()

    def _propose(self, rows):
        """This round's drafts per row (lists of token ids): none in the plain loop, one token per
        row; ``spec_regen.SpecRegenerator`` drafts."""
        return [[]] * len(rows)

    def _tally(self, drafts: list, accepted: int, pushed: int) -> None:
        """A row's round: its drafts, how many were accepted, how many tokens it pushed."""

    def _step(self, rows) -> list:
        """One round for every active row (slot b = rows[b]): the target runs each row's last token
        and its drafts in one pass, the reference engine's ``accept_round`` keeps the target's own
        greedy tokens, and a row's tokens are pushed up to the end of its turn (never past an end
        of turn or the turn's room). Returns the finished slots."""
        drafts = self._propose(rows)
        ids = torch.tensor([t for r, d in zip(rows, drafts) for t in [r.seq[-1]] + d], dtype=torch.long)
        normed, f = self.engine.verify(ids, [len(r.seq) - 1 for r in rows], [1 + len(d) for d in drafts],
                                       bool(self.capture))
        toks, margins = self._argmax(normed)
        done, off = [], 0
        for b, (r, d) in enumerate(zip(rows, drafts)):
            n = 1 + len(d)
            a, commit = accept_round(d, toks[off:off + n])
            pushed = 0
            for tok, margin in zip(commit, margins[off:off + n].tolist()):
                self._push(r, tok, margin)
                pushed += 1
                if self.turns.turn_over(r):
                    break
            self._tally(d, a, pushed)
            if f is not None:
                r.feats.append(f[off:off + pushed])  # the inputs fed for the pushed tokens
            off += n
            if self.turns.turn_over(r) and not self._next_turn(r, b):
                done.append(b)
        return done

    def run(self, convs):
        """(sequences, masks, features) in the order of ``convs`` (``Regenerator.run``'s API)."""
        return columns(self.stream(enumerate(convs)))
