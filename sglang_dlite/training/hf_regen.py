"""HF ``generate`` regeneration (``gen-data --engine hf``): batched, turn by turn, left padding.

Also the chat rendering both engines share (``start``: system + first user turn + assistant
header; ``turn_suffix``: the ids appended after a finished assistant turn), which
``fast_regen.FastRegenerator`` reuses. Sampling (``--temperature > 0``) needs this engine.
"""

from __future__ import annotations

import torch

from ..engine import LayerCapture
from .features import feature_modules


class Regenerator:
    """Batched, turn-by-turn regeneration of conversations with a HF causal LM."""

    def __init__(self, model, tok, max_new_tokens=256, max_len=2048, max_user_tokens=1024,
                 temperature=0.0, top_p=1.0, capture_layers=None):
        self.model, self.tok = model, tok
        # Target features captured during generation (no second target pass): outputs of the
        # decoder layers ``capture_layers`` and of the final norm, per position, in fp16.
        self.capture_layers = list(capture_layers) if capture_layers else None
        self._modules = feature_modules(model, self.capture_layers) if self.capture_layers else []
        self.max_new, self.max_len, self.max_user = max_new_tokens, max_len, max_user_tokens
        self.temperature, self.top_p = temperature, top_p
        eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
        self.eos = int(eos if eos is not None else model.config.eos_token_id)
        self.pad = int(tok.pad_token_id if tok.pad_token_id is not None else self.eos)
        self.new_tokens = 0

    def close(self):
        """Nothing to release: the capture hooks live only while ``generate_batch`` runs."""

    def _render_ids(self, messages, gen_prompt):
        out = self.tok.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def _clip_user(self, text):
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_user:
            return text
        # keep the head and the tail (instructions often come last)
        tail = min(96, self.max_user // 4)
        return self.tok.decode(ids[: self.max_user - tail]) + "\n...\n" + self.tok.decode(ids[-tail:])

    def start(self, conv):
        """Token ids of the first prompt (system + first user turn + assistant header)."""
        msgs = ([{"role": "system", "content": conv["system"]}] if conv.get("system") else [])
        msgs.append({"role": "user", "content": self._clip_user(conv["users"][0])})
        return self._render_ids(msgs, True)

    def turn_suffix(self, user_text):
        """Ids appended after a finished assistant turn (ends with <|im_end|>) for the next user turn."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        a = self.tok.apply_chat_template(probe, tokenize=False)
        b = self.tok.apply_chat_template(probe + [{"role": "user", "content": self._clip_user(user_text)}],
                                         add_generation_prompt=True, tokenize=False)
        assert b.startswith(a)
        # a ends with "<|im_end|>\n"; the generated turn already ends with <|im_end|>.
        tail = "\n" + b[len(a):] if a.endswith("<|im_end|>\n") else b[len(a):]
        return self.tok(tail, add_special_tokens=False)["input_ids"]

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
            if self.eos in row:
                row = row[: row.index(self.eos) + 1]
            res.append(row)
            self.new_tokens += len(row)
        if self.capture_layers:
            buf = cap.take()
            # buf[k][0]: prefill [B, L, H]; buf[k][t]: decode step t consumed generated token t-1.
            per_k = []
            for chunks in buf:
                dec = torch.cat(chunks[1:], dim=1) if len(chunks) > 1 else chunks[0][:, :0]
                per_k.append((chunks[0], dec))
            for i, (p, row) in enumerate(zip(prompts, res)):
                n_dec = max(len(row) - 1, 0)
                f = torch.stack([torch.cat([pre[i, L - len(p):], dec[i, :n_dec]], dim=0) for pre, dec in per_k], dim=1)
                feats.append(f.cpu())  # [len(p) + len(row) - 1, L+1, H]
            return res, feats
        return res, None

    def run(self, convs):
        """Returns (sequences, masks) for a list of conversations, batched per turn."""
        seqs = [self.start(c) for c in convs]
        masks = [[0] * len(s) for s in seqs]
        feats = [None] * len(convs)
        alive = [len(s) + 16 < self.max_len for s in seqs]
        turn = 0
        while True:
            idx = [i for i, c in enumerate(convs) if alive[i] and turn < len(c["users"])]
            if not idx:
                break
            if turn > 0:
                for i in idx:
                    suf = self.turn_suffix(convs[i]["users"][turn])
                    if len(seqs[i]) + len(suf) + 16 >= self.max_len:
                        alive[i] = False
                        continue
                    seqs[i] += suf
                    masks[i] += [0] * len(suf)
                idx = [i for i in idx if alive[i]]
                if not idx:
                    break
            # sort by length so similar prompts share a batch (less padding)
            idx.sort(key=lambda i: len(seqs[i]))
            room = min(self.max_new, self.max_len - max(len(seqs[i]) for i in idx))
            outs, fs = self.generate_batch([seqs[i] for i in idx], room)
            for j, (i, o) in enumerate(zip(idx, outs)):
                if fs is not None:
                    feats[i] = fs[j]
                seqs[i] += o
                masks[i] += [1] * len(o)
                if not o or o[-1] != self.eos:
                    alive[i] = False  # truncated turn: the conversation ends here
            turn += 1
        return seqs, masks, feats
