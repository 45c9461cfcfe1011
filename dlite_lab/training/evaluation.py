"""Evaluation of a drafter in training: expected greedy τ on held-out anchors (with a 95 % CI) and
per-position accuracy, scored with the speculative core's acceptance; optionally the reference
engine on built-in workloads (``--eval-workloads``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from dlite_lab.reference.drafters import DLiteEngineDrafter
from dlite_lab.reference.engine import ReferenceEngine
from sglang_dlite.model.dlite import DLiteDrafter
from sglang_dlite.drafting.accept import greedy_accept_length
from sglang_dlite.drafting.tau import tau_of_committed
from dlite_lab.workloads import load_workload
from dlite_lab.workloads.replay import eos_token_ids, evaluate_tau
from dlite_lab.training.dataset import FeatureData, concat_groups, to_device


def model_forward(model, b, vocab: Optional[torch.Tensor] = None):
    """Logits [B, K, V] (or [B, K, |vocab|] over the token subset ``vocab``: the frozen LM head's
    rows for those tokens only -- the training-time vocabulary subset, see ``--vocab-subset``).
    A batch with history rows (the teacher / window ablations) needs an ``AblationDrafter``."""
    extra = {} if b.get("history") is None else {"history": b["history"], "round_offset": b["round_offset"]}
    return model(b["context_hidden"], b["context_valid"], b["anchor_ids"], vocab=vocab,
                 feedback_tokens=b["labels"] if model.config.head_input == "token" else None, **extra)


def scored_drafts(model, b) -> torch.Tensor:
    """The drafts [B, K] a greedy round would make at batch ``b``'s anchors, from the scoring
    forward (teacher-forced token head): the argmax over the drafting vocabulary when the drafter
    has one (a shipped export drafts among those ids only), else over the whole vocabulary."""
    vocab = model.draft_vocab if model.config.draft_vocab_size else None
    idx = model_forward(model, b, vocab=vocab).float().argmax(-1)
    return idx if vocab is None else vocab[idx]


class GreedyTally:
    """Greedy-round scores accumulated over batches of held-out anchors: per anchor the committed
    tokens (1 + leading drafts equal to the labels, stopping at the first invalid label), per draft
    position the accuracy over valid labels. Shared by DLite's and the KV baselines' scoring."""

    def __init__(self, K: int):
        self.taus, self.hits, self.n_valid = [], torch.zeros(K), torch.zeros(K)

    def add(self, draft: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> None:
        """``draft``, ``labels``, ``valid``: [N, K] for N anchors."""
        self.taus.append(greedy_accept_length(draft, labels, valid))
        self.hits += ((draft == labels) & valid).float().sum(0)
        self.n_valid += valid.float().sum(0)

    def result(self):
        """(tau [N], accuracy per position)."""
        return torch.cat(self.taus), (self.hits / self.n_valid.clamp(min=1)).tolist()


@torch.no_grad()
def greedy_scores(model: DLiteDrafter, data: FeatureData, groups, autocast, chunk: int = 8, device=None):
    """Per held-out anchor: the committed tokens of a greedy round there (1 + leading drafts equal
    to the target's greedy tokens; the data is greedy-regenerated, so labels are the target's
    continuation), and per draft position the accuracy. Returns (tau [N], acc per position).
    History-free drafters run ``chunk`` sequences' anchors per forward, others one sequence.
    ``device``: where the model is (batches are moved there; None: the CPU). A drafter with a
    drafting vocabulary (a shipped export) is scored as it drafts: the argmax over those ids."""
    cfg = model.config
    C, K = cfg.num_context_positions, cfg.block_size
    hist = cfg.history_window  # 0 none, None full, W window
    tally = GreedyTally(K)
    step = chunk if hist == 0 else 1
    for i in range(0, len(groups), step):
        gs = [data.group(si, a, C, K, hist, False) for si, a in groups[i:i + step]]
        b = concat_groups(gs) if hist == 0 else gs[0]  # a history is per sequence
        draft_in = b if device is None else to_device(b, torch.device(device))
        with autocast():
            draft = scored_drafts(model, draft_in).cpu()
        tally.add(draft, b["labels"], b["valid"])
    return tally.result()


def evaluate(model: DLiteDrafter, data: FeatureData, groups, autocast, device=None) -> dict:
    """Expected greedy tau on held-out anchors and per-position accuracy (``greedy_scores``)."""
    model.eval()
    tau, acc = greedy_scores(model, data, groups, autocast, device=device)
    model.train()
    half = 1.96 * float(tau.std()) / math.sqrt(len(tau)) if len(tau) > 1 else 0.0
    m = tau_of_committed(tau)
    return {"tau_proxy": m, "tau_ci95": [round(m - half, 4), round(m + half, 4)], "acc_per_pos": [round(x, 4) for x in acc],
            "eval_anchors": int(len(tau))}


def make_engine_eval(target, tokenizer, workloads: list, max_convs: int, max_new_tokens: int):
    """Held-out tau through the reference engine (exact rounds) on a small workload sample:
    ``workloads`` e.g. ["sharegpt-heldout", "agent-stdlib"]; run at the end of every stage."""
    convs = {w: load_workload(w, max_convs=max_convs) for w in workloads}

    def fn(model, stage, step):
        dev = model.mask_embed.device
        model.eval().to("cpu")  # beside the target (the reference engine runs on the CPU)
        out = {}
        eng = ReferenceEngine(target, DLiteEngineDrafter(model), eos_token_ids=eos_token_ids(tokenizer, target))
        try:
            for w, cv in convs.items():
                r = evaluate_tau(eng, cv, max_new_tokens, tokenizer)
                out[f"engine_tau/{w}"] = round(float(r["tau"]), 3)
        except Exception as exc:  # noqa: BLE001 - an eval failure must not lose the training run
            out["engine_eval_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            eng.close()
            model.to(dev).train()
        print(f"train[{stage}] step {step}: reference-engine tau {out}")
        return out

    return fn


