"""``gen-data --engine sglang``: the target generates in sglang's offline engine, then one target
pass over the finished sequences gives the features.

* **Generation**: ``sglang.Engine`` (on this CPU: the project's CPU stack, ``cpu_launch``; on a
  GPU: CUDA graphs, FlashInfer, whatever sglang picks) with continuous batching and the radix
  cache. Every conversation is one asyncio task that submits its turns one after another, all
  conversations concurrently: the scheduler batches whatever turns are ready, and a later turn
  re-uses its earlier turns' KV from the radix cache (only the new user turn is prefilled).
  Greedy (temperature 0); a turn stops at the chat end-of-turn token (``stop_token_ids``) or at
  its room, the same rule as the fast and hf engines. sglang also stops at the model's other EOS
  ids; such a turn is resumed where it stopped, so only ``<|im_end|>`` ends a turn.
* **Features and exactness**: the float32 pass of ``exactness.relabel`` (the fast engine's
  ``--relabel`` pass) gives the features and counts the generated tokens that are not the float32
  target's greedy choice per shard (``tokens_not_fp32_greedy``); with ``relabel`` (implied by
  ``--dtype bfloat16``) it also cuts a sequence at the first one.
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from sglang_dlite.serving.cpu_launch import start_engine
from sglang_dlite.errors import DLiteInputError
from dlite_lab.training import exactness
from dlite_lab.training.turns import TurnRules, columns


def process_tree_cpu_seconds() -> float:
    """CPU seconds of this process and its live children (sglang's scheduler and detokenizer)."""
    import psutil  # optional: comes with the sglang extra

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for c in me.children(recursive=True):
        try:
            total += sum(c.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


class SglangRegenerator:
    """Turn-by-turn greedy regeneration of conversations in a started sglang engine (turn rules:
    ``turns.TurnRules``); ``model``: the HF target for the feature / exactness pass (``None``: no pass)."""

    def __init__(self, target_path, model, turns: TurnRules, capture_layers=None, batch_size=32, dtype="float32",
                 threads=1, engine=None, **engine_kw):
        if dtype not in ("float32", "bfloat16"):
            raise DLiteInputError(f"--engine sglang: --dtype must be float32 or bfloat16 (got {dtype!r}).")
        self.model, self.turns = model, turns
        self.capture = list(capture_layers) if capture_layers else []
        self.dtype, self.batch_size = dtype, batch_size
        self.new_tokens = 0
        self.stats = {"requests": 0, "resumed_turns": 0, "gen_s": 0.0, "feature_pass_s": 0.0}
        self._owns_engine = engine is None
        if engine is None:
            kw = dict(dtype=dtype, max_running_requests=batch_size, skip_tokenizer_init=True)
            if torch.cuda.is_available():  # sglang's own GPU defaults (CUDA graphs, its attention backend)
                import sglang as sgl  # optional: the sglang extra

                kw.update(model_path=str(target_path), log_level="error", random_seed=0)
                engine = sgl.Engine(**{**kw, **engine_kw})
            else:  # the project's CPU stack
                os.environ["OMP_NUM_THREADS"] = str(threads)  # the scheduler subprocess's torch threads
                kw.update(max_total_tokens=min(batch_size * turns.max_len, 1 << 17))
                engine = start_engine(target_path, **{**kw, **engine_kw})
        self.engine = engine

    def close(self):
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()
        self.engine = None

    # ------------------------------------------------------------------ generation
    async def _conv(self, c):
        if not self.turns.begin(c):
            return self.turns.record(c)
        while True:
            while not self.turns.turn_over(c):
                left = c.room - c.gen
                out = await self.engine.async_generate(
                    input_ids=list(c.seq), sampling_params={"temperature": 0.0, "max_new_tokens": left,
                                                            "stop_token_ids": [self.turns.eos]})
                self.stats["requests"] += 1
                ids = self.turns.until_end(list(out["output_ids"])[:left])
                self.turns.push(c, ids)
                self.new_tokens += len(ids)
                if not ids:
                    break
                if not self.turns.turn_over(c):
                    self.stats["resumed_turns"] += 1  # stopped at another EOS id of the model: go on
            if not self.turns.next_turn(c):
                return self.turns.record(c)

    def generate(self, convs):
        """(sequences, masks) in the order of ``convs``, all conversations in flight at once."""
        async def all_convs():
            return await asyncio.gather(*[self._conv(self.turns.open(i, c)) for i, c in enumerate(convs)])

        t0 = time.time()
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
        seqs, masks, _ = columns(loop.run_until_complete(all_convs()))
        self.stats["gen_s"] += time.time() - t0
        return seqs, masks

    def run(self, convs, relabel: bool = False):
        """(sequences, masks, features or [None]*n) as ``Regenerator.run``; per-call exactness
        counts in ``self.last`` (``exactness.relabel``'s; ``relabel``: cut at the first token that
        is not the float32 target's greedy choice)."""
        seqs, masks = self.generate(convs)
        self.last = {}
        if self.model is None:
            return seqs, masks, [None] * len(seqs)
        t0 = time.time()
        seqs, masks, feats, self.last = exactness.relabel(self.model, seqs, masks, self.capture or None, cut=relabel)
        self.stats["feature_pass_s"] += time.time() - t0
        # a conversation that generated nothing has no features (the other engines' layout)
        return seqs, masks, [f if sum(m) else None for m, f in zip(masks, feats)]
