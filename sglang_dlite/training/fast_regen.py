"""Fast greedy regeneration for ``gen-data --engine fast``: a pure-torch batched decode loop over a
HF Llama target with a preallocated static KV cache and continuous batching.

* **Static KV cache** and the batched forward: ``fast_llama.FastLlama`` (one preallocated
  ``[layers, slots, kv_heads, max_len, head_dim]`` cache, written in place).
* **Continuous batching**: every active conversation occupies one slot; a decode step runs all
  slots at their own positions (one GEMM per weight for the whole batch); a finished turn of a
  multi-turn conversation appends the next user turn to the *same* slot (only the new tokens are
  prefilled: earlier turns are never recomputed), a finished conversation's slot is refilled from
  the queue at once. Prompts are length-sorted within a window so that slots decode similar
  context lengths (the attention of a step runs to the longest active context).
* **Features captured while generating** (outputs of the capture layers and of the final norm,
  fp16, the same layout as ``features.save_features``): no second target pass.
* fp32 (default) or bf16; fp32 weights packed once for MKL's sgemm (``packed=False``: plain
  matmuls, for A/B; end to end +3 % and +11 % in two runs of 64 conversations at 32 slots).

Exactness: the output is the target's greedy decoding, computed with other GEMM shapes than
HF's batch-1 forward, so a near-tie can round the other way. ``exactness.relabel`` runs one float32 HF
forward over finished sequences, counts the generated tokens that are not the float32 target's
greedy choice, and cuts a sequence at its first such token (the target's own choice becomes the
last token; later turns, which were conditioned on the other choice, are dropped); its features
replace the captured ones. ``bench/gen_throughput.py`` measures both.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Iterator

import torch

from ..engine import accept_round
from .fast_llama import FastLlama
from .hf_regen import Regenerator


class _Row:
    __slots__ = ("key", "conv", "seq", "mask", "feats", "turn", "room", "gen", "margin")

    def __init__(self, key, conv, seq):
        self.key, self.conv, self.seq = key, conv, seq
        self.mask = [0] * len(seq)
        self.feats = []
        self.turn = 0
        self.room = 0
        self.gen = 0
        self.margin = math.inf


class FastRegenerator:
    """Greedy turn-by-turn regeneration of conversations (the same sequences ``Regenerator``
    builds: the chat template's user turns + the target's own ids), batched continuously.

    ``tokenizer_helper``: a ``hf_regen.Regenerator`` (its prompt/turn rendering is reused)."""

    def __init__(self, model, tok, max_new_tokens=256, max_len=2048, max_user_tokens=1024, capture_layers=None,
                 batch_size=32, dtype=torch.float32, sort_window=64, continue_truncated=False, packed=True,
                 attention="auto"):
        self.helper = Regenerator(model, tok, max_new_tokens, max_len, max_user_tokens, capture_layers=None)
        self.eos, self.max_new, self.max_len = self.helper.eos, max_new_tokens, max_len
        self.capture = list(capture_layers) if capture_layers else []
        self.engine = FastLlama(model, batch_size, max_len, dtype=dtype, capture_layers=self.capture, packed=packed,
                                attention=attention)
        self.batch_size, self.sort_window = batch_size, sort_window
        # A turn cut by max_new_tokens ends the conversation (Regenerator's rule), or, with
        # continue_truncated, is closed with an end-of-turn token that is not a training label
        # (mask 0) and the conversation goes on (long multi-turn contexts from a rambling target).
        self.continue_truncated = continue_truncated
        self.new_tokens = 0
        self.L1 = len(self.capture) + 1

    # ------------------------------------------------------------------ rows
    def _argmax(self, normed):
        lg = self.engine.logits(normed).float()
        top = torch.topk(lg, 2, dim=-1)
        return top.indices[..., 0], top.values[..., 0] - top.values[..., 1]

    def _extend(self, row: _Row, slot: int, start: int):
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

    def _begin_turn(self, row: _Row) -> bool:
        """Set the room of the current turn; False if the conversation cannot continue."""
        row.room = min(self.max_new, self.max_len - len(row.seq))
        row.gen = 0
        return row.room > 0

    def _push(self, row: _Row, tok: int, margin: float):
        row.seq.append(tok)
        row.mask.append(1)
        row.gen += 1
        row.margin = min(row.margin, margin)
        self.new_tokens += 1

    def _turn_over(self, row: _Row) -> bool:
        return row.seq[-1] == self.eos or row.gen >= row.room

    def _next_turn(self, row: _Row, slot: int) -> bool:
        """After a finished turn: append the next user turn to the slot (prefill only the new ids).
        Returns False if the conversation is over."""
        closed = row.seq[-1] == self.eos
        if not closed and not getattr(self, "continue_truncated", False):
            return False  # truncated turn: the conversation ends here
        row.turn += 1
        if row.turn >= len(row.conv["users"]):
            return False
        suf = self.helper.turn_suffix(row.conv["users"][row.turn])
        if not closed:
            suf = [self.eos] + list(suf)  # close the cut turn (mask 0: not generated)
        if len(row.seq) + len(suf) + 16 >= self.max_len:
            return False
        start = len(row.seq) - 1  # the turn's last token (EOS) has not been fed yet
        row.seq += suf
        row.mask += [0] * len(suf)
        if not self._begin_turn(row):
            return False
        self._extend(row, slot, start)
        return True

    def _admit(self, key, conv, slot: int, seq):
        """Start a conversation (first prompt ``seq``) in ``slot``: (row, active?)."""
        row = _Row(key, conv, list(seq))
        if not (len(seq) + 16 < self.max_len) or not self._begin_turn(row):
            return row, False
        self._extend(row, slot, 0)
        if self._turn_over(row) and not self._next_turn(row, slot):
            return row, False
        return row, True

    def _finish(self, row: _Row):
        feats = None
        if self.capture:
            n = len(row.seq) - 1  # every position but the last was fed through the target
            if row.feats:
                feats = torch.cat(row.feats, 0)[:n]
        return row.key, row.seq, row.mask, feats, row.margin

    # ------------------------------------------------------------------ driver
    def stream(self, items: Iterable) -> Iterator[tuple]:
        """items: (key, conv) pairs. Yields (key, seq, mask, feats [len-1, L+1, H] fp16 or None,
        min top-1/top-2 logit margin of its generated tokens) as conversations finish."""
        it = iter(items)
        window: list = []

        def pull():
            if not window:
                for key, conv in it:
                    seq = self.helper.start(conv)
                    window.append((len(seq), (key, conv, seq)))
                    if len(window) >= self.sort_window:
                        break
                window.sort(key=lambda t: -t[0])  # pop() takes the shortest first
            return window.pop()[1] if window else None

        rows: list = []  # rows[b] decodes in cache slot b
        while True:
            while len(rows) < self.batch_size:
                nxt = pull()
                if nxt is None:
                    break
                row, active = self._admit(nxt[0], nxt[1], len(rows), nxt[2])
                if active:
                    rows.append(row)
                else:
                    yield self._finish(row)
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
        """This round's drafts per row (lists of token ids); None: the plain loop, one token per row
        (``FastLlama.decode``). ``spec_regen.SpecRegenerator`` drafts."""
        return None

    def _tally(self, drafts: list, accepted: int, pushed: int) -> None:
        """A row's round: its drafts, how many were accepted, how many tokens it pushed."""

    def _step(self, rows) -> list:
        """One round for every active row (slot b = rows[b]): the target runs each row's last token
        and its drafts in one pass, the reference engine's ``accept_round`` keeps the target's own
        greedy tokens, and a row's tokens are pushed up to the end of its turn (never past an end
        of turn or the turn's room). Returns the finished slots."""
        drafts = self._propose(rows)
        if drafts is None:
            drafts = [[]] * len(rows)
            ids = torch.tensor([r.seq[-1] for r in rows], dtype=torch.long)
            pos = torch.tensor([len(r.seq) - 1 for r in rows], dtype=torch.long)
            normed, f = self.engine.decode(ids, pos, bool(self.capture))
        else:
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
                if self._turn_over(r):
                    break
            self._tally(d, a, pushed)
            if f is not None:
                r.feats.append(f[off:off + pushed])  # the inputs fed for the pushed tokens
            off += n
            if self._turn_over(r) and not self._next_turn(r, b):
                done.append(b)
        return done

    def run(self, convs):
        """(sequences, masks, features) in the order of ``convs`` (``Regenerator.run``'s API)."""
        out = {}
        self.margins = {}
        for key, seq, mask, feats, margin in self.stream(enumerate(convs)):
            out[key] = (seq, mask, feats)
            self.margins[key] = margin
        seqs = [out[i][0] for i in range(len(convs))]
        masks = [out[i][1] for i in range(len(convs))]
        feats = [out[i][2] for i in range(len(convs))] if self.capture else [None] * len(convs)
        return seqs, masks, feats
