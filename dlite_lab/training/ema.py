"""Exponential moving average of the trained weights (Polyak averaging), ``--ema-decay``.

After every optimizer step ``ema = d_t * ema + (1 - d_t) * w`` with the warmed-up decay
``d_t = min(d, (1 + t) / (10 + t))`` (t = steps taken), so the first steps do not pin the
average to the starting weights. Evaluations and the saved drafter use the average; the optimizer
keeps stepping the raw weights. The state rides in the stage checkpoint, so a resumed run
continues the same average.

Why: averaging weights of one lineage is what lifted the shipped drafter (v11 = the uniform average
of v8 and its two fine-tunes: pooled τ 1.539 vs 1.520-1.533 for each alone); the moving average
gets that effect inside one run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import List

import torch


def warmed_decay(decay: float, steps_taken: int) -> float:
    return min(decay, (1.0 + steps_taken) / (10.0 + steps_taken))


class WeightEMA:
    """The moving average of ``params`` (the trainable parameters, in the optimizer's order)."""

    def __init__(self, params: List[torch.nn.Parameter], decay: float):
        self.params = list(params)
        self.decay = float(decay)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, steps_taken: int) -> None:
        """Fold the current weights in; ``steps_taken``: optimizer steps before this one."""
        w = 1.0 - warmed_decay(self.decay, steps_taken)
        for e, p in zip(self.shadow, self.params):
            e.lerp_(p.detach(), w)

    @torch.no_grad()
    def _swap(self) -> None:
        for e, p in zip(self.shadow, self.params):
            tmp = p.detach().clone()
            p.copy_(e)
            e.copy_(tmp)

    @contextmanager
    def swapped(self):
        """The parameters hold the average inside the block, their trained values again after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Make the average the parameters' values (the end of a stage: what is saved and handed on)."""
        for e, p in zip(self.shadow, self.params):
            p.copy_(e)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [e.detach().cpu() for e in self.shadow]}

    def load_state_dict(self, st: dict) -> None:
        if len(st["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state holds {len(st['shadow'])} tensors, the drafter trains {len(self.shadow)}")
        for e, s in zip(self.shadow, st["shadow"]):
            e.copy_(s.to(e.device))
