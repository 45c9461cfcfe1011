"""CUDA graphs of the DLite drafter's greedy propose, one per batch-size bucket (CUDA only)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang_dlite.model.dlite import DLiteDrafter


class DrafterCudaGraphs:
    """CUDA only: the drafter's greedy propose captured once per batch-size bucket.

    The drafter has no KV and no attention metadata, so a graph is a pure function of three
    static input buffers (context, validity, anchor) and one output buffer (tokens).
    """

    def __init__(self, drafter: DLiteDrafter, max_bs: int, device, dtype, num_drafts: Optional[int] = None,
                 with_confidence: bool = False):
        cfg = drafter.config
        self.with_confidence = with_confidence  # hybrid drafting also reads DLite's confidences
        self.drafter = drafter
        self.buckets = [b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256) if b <= max_bs]
        if not self.buckets or self.buckets[-1] < max_bs:
            self.buckets.append(max_bs)
        L, C, H = cfg.num_capture_layers, cfg.num_context_positions, cfg.target_hidden_size
        n = self.buckets[-1]
        self.ctx = torch.zeros((n, L, C, H), dtype=dtype, device=device)
        self.valid = torch.zeros((n, C), dtype=torch.bool, device=device)
        self.anchor = torch.zeros((n,), dtype=torch.int64, device=device)
        self.graphs, self.outs = {}, {}
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                for _ in range(2):  # warm-up outside the graph
                    drafter.propose(self.ctx[:bs], self.valid[:bs], self.anchor[:bs], num_drafts=num_drafts,
                                    return_confidence=with_confidence)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    prop = drafter.propose(self.ctx[:bs], self.valid[:bs], self.anchor[:bs], num_drafts=num_drafts,
                                           return_confidence=with_confidence)
                    out = (prop.tokens, prop.confidence) if with_confidence else prop.tokens
                pool = g.pool()
                self.graphs[bs], self.outs[bs] = g, out
        torch.cuda.current_stream().wait_stream(stream)

    def propose(self, ctx, valid, anchor) -> Optional[torch.Tensor]:
        bs = ctx.shape[0]
        bucket = next((b for b in self.buckets if b >= bs), None)
        if bucket is None:
            return None
        self.ctx[:bs].copy_(ctx)
        self.valid[:bs].copy_(valid)
        self.anchor[:bs].copy_(anchor)
        if bucket > bs:
            self.valid[bs:bucket].fill_(False)
            self.anchor[bs:bucket].fill_(0)
        self.graphs[bucket].replay()
        if self.with_confidence:
            toks, conf = self.outs[bucket]
            return toks[:bs], conf[:bs]
        return self.outs[bucket][:bs]
