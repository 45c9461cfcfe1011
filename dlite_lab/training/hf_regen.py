"""HF ``generate`` regeneration (``gen-data --engine hf``): batched, turn by turn, left padding.
Sampling (``--temperature > 0``) needs this engine; its turn rules are ``turns.TurnRules``."""

from __future__ import annotations

import torch

from dlite_lab.reference.engine import LayerCapture
from dlite_lab.training.features import feature_modules
from dlite_lab.training.turns import TurnRules, columns


class Regenerator:
    """Batched, turn-by-turn regeneration of conversations with a HF causal LM."""

    def __init__(self, model, turns: TurnRules, temperature=0.0, top_p=1.0, capture_layers=None):
        self.model, self.turns = model, turns
        # Target features captured during generation (no second target pass): outputs of the
        # decoder layers ``capture_layers`` and of the final norm, per position, in fp16.
        self.capture_layers = list(capture_layers) if capture_layers else None
        self._modules = feature_modules(model, self.capture_layers) if self.capture_layers else []
        self.temperature, self.top_p = temperature, top_p
        self.eos = self.turns.eos
        self.pad = int(turns.tok.pad_token_id if turns.tok.pad_token_id is not None else self.eos)
        self.new_tokens = 0

    def close(self):
        """Nothing to release: the capture hooks live only while ``generate_batch`` runs."""

    def generate_batch(self, prompts, max_new):
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), self.pad, dtype=torch.long)
        att = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            att[i, L - len(p):] = 1
        dev = next(self.model.parameters()).device  # --device: the target may run on a GPU
        ids, att = ids.to(dev), att.to(dev)
        kw = dict(do_sample=False) if self.temperature <= 0 else dict(do_sample=True, temperature=self.temperature, top_p=self.top_p)
        with torch.no_grad(), LayerCapture(self._modules, dtype=torch.float16) as cap:
            out = self.model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new,
                                      eos_token_id=self.eos, pad_token_id=self.pad, **kw)
        res, feats = [], []
        for i, row in enumerate(out[:, L:].tolist()):
            row = self.turns.until_end(row)
            res.append(row)
            self.new_tokens += len(row)
        if self.capture_layers:
            # module k's chunks[0]: the prefill [B, L, H]; chunks[t]: decode step t consumed generated token t-1
            per_k = [(chunks[0], torch.cat(chunks[1:], dim=1) if len(chunks) > 1 else chunks[0][:, :0])
                     for chunks in cap.take()]
            for i, (p, row) in enumerate(zip(prompts, res)):
                n_dec = max(len(row) - 1, 0)
                f = torch.stack([torch.cat([pre[i, L - len(p):], dec[i, :n_dec]], dim=0) for pre, dec in per_k], dim=1)
                feats.append(f.cpu())  # [len(p) + len(row) - 1, L+1, H]
            return res, feats
        return res, None

    def run(self, convs):
        """(sequences, masks, features or None each) of ``convs``: every turn of the conversations
        still going is generated in one batch."""
        cs = [self.turns.open(i, c) for i, c in enumerate(convs)]
        live = [c for c in cs if self.turns.begin(c)]
        while live:
            live.sort(key=lambda c: (len(c.seq), c.key))  # similar lengths share a batch (less padding)
            outs, fs = self.generate_batch([c.seq for c in live], min(c.room for c in live))
            for j, (c, o) in enumerate(zip(live, outs)):
                self.turns.push(c, o)
                if fs is not None:
                    c.feats = [fs[j]]  # the whole sequence's: generate runs the prompt again every turn
            live = [c for c in live if self.turns.next_turn(c)]
        return columns(self.turns.record(c) for c in cs)
