"""Replay workload conversations through an engine and aggregate acceptance / speed metrics.

Reusable by ``bench/acceptance.py``, the sglang end-to-end bench and the training evaluation
(``evaluate_tau``). The engine only needs the ``ReferenceEngine`` interface:
``generate(prompt_ids, max_new_tokens, temperature=, top_p=, seed=, session=, speculative=)``
returning a result with ``output_ids``, ``rounds`` (``context_len``, ``accepted``, ``committed``,
``draft_ms``, ``verify_ms``), ``prefill_ms``, ``decode_ms``, ``reused_prefix``; ``new_session()``;
``max_positions``; ``drafter.num_drafts``.

Per conversation one speculative ``Session`` (and one target-alone session when the
autoregressive baseline runs), so each turn reuses the KV of the previous ones. Every turn is run
by the target alone first (when requested), then speculatively, on the same prompt.

Generated placeholders (turns with no recorded reply: MT-Bench turn 1, BFCL turns) continue with
the **target-alone** reply when the baseline runs, else with the speculative reply. Under greedy
decoding both are the target's greedy output for a lossless drafter, so every drafter sees
identical contexts. Under sampling the target-alone reply (seeded per turn) still does not depend
on the drafter, so contexts stay identical across drafters when the baseline runs; with
``evaluate_tau`` (no baseline) at temperature > 0 they differ between drafters.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch
from tqdm.auto import tqdm

from dlite_lab.reference.engine import GenerationResult
from sglang_dlite.drafting.tau import TAU_DEFINITION, committed_per_round, tau
from dlite_lab.workloads.render import count_turns, render_turns

CONTEXT_BUCKETS = (("0-1k", 0, 1024), ("1-2k", 1024, 2048), ("2-4k", 2048, 4096), ("4-8k", 4096, 8192))
# how far into its answer a round starts (output tokens committed before it): does acceptance decay?
OUTPUT_POSITION_BUCKETS = (("0-63", 0, 64), ("64-127", 64, 128), ("128-255", 128, 256), ("256-511", 256, 512),
                           ("512-1023", 512, 1024), ("1024+", 1024, 1 << 62))
MAX_MISMATCH_DETAILS = 20


def eos_token_ids(tokenizer, target=None) -> list:
    """EOS ids for the engine: the tokenizer's, the generation config's, and end-of-turn tokens."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gc = getattr(target, "generation_config", None)
    e = getattr(gc, "eos_token_id", None)
    if e is not None:
        ids.update(int(x) for x in (e if isinstance(e, (list, tuple)) else [e]))
    vocab = tokenizer.get_vocab()
    for t in ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>"):
        if t in vocab:
            ids.add(int(vocab[t]))
    return sorted(ids)


def turn_seed(seed: int, conv_id: str, index: int) -> int:
    h = hashlib.sha256(f"{seed}:{conv_id}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "big")


def bucket_of(context_len: int) -> str:
    for name, lo, hi in CONTEXT_BUCKETS:
        if lo <= context_len < hi:
            return name
    return ">=8k"


class ARCache:
    """Target-alone (autoregressive) turn results shared between runs: the baseline does not depend
    on the drafter, so the second drafter measured on a workload reuses the first one's target-alone
    outputs and timings instead of regenerating them (``bench/acceptance.py --ar-cache FILE``).
    JSON lines keyed by a hash of (target, prompt ids, max new tokens, sampling, seed)."""

    FIELDS = ("prompt_len", "output_ids", "prefill_ms", "decode_ms", "reused_prefix")  # of a GenerationResult

    def __init__(self, path: str, target_id: str):
        self.path, self.target_id, self.table = path, str(target_id), {}
        self.hits = 0
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a torn last line from an interrupted writer
                    self.table[rec["key"]] = rec

    def key(self, prompt_ids, max_new_tokens, temperature, top_p, seed) -> str:
        h = hashlib.sha256(f"{self.target_id}|{max_new_tokens}|{temperature}|{top_p}|{seed}|".encode())
        h.update(",".join(map(str, prompt_ids)).encode())
        return h.hexdigest()

    def get(self, key):
        rec = self.table.get(key)
        if rec is None:
            return None
        self.hits += 1
        return GenerationResult(**{k: copy.copy(rec[k]) for k in self.FIELDS})

    def put(self, key, res) -> None:
        rec = {"key": key, **{k: copy.copy(getattr(res, k)) for k in self.FIELDS}}
        self.table[key] = rec
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps(rec) + "\n")


@dataclass
class _Side:
    turns: int = 0
    generated: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0

    def add(self, res):
        self.turns += 1
        self.generated += len(res.output_ids)
        self.prefill_ms += res.prefill_ms
        self.decode_ms += res.decode_ms
        self.prompt_tokens += res.prompt_len
        self.reused_tokens += res.reused_prefix

    def tokens_per_s(self) -> Optional[float]:
        t = self.prefill_ms + self.decode_ms
        return None if not self.turns or t <= 0 else self.generated / (t / 1e3)

    def decode_tokens_per_s(self) -> Optional[float]:
        # tokens after the first one (which comes from the prefill) over the decode time
        return None if self.decode_ms <= 0 else (self.generated - self.turns) / (self.decode_ms / 1e3)

    def timings(self, side: str) -> dict:
        """The replay JSON's time and speed keys of this side ("spec" / "ar")."""
        return {f"{side}_prefill_ms": self.prefill_ms, f"{side}_decode_ms": self.decode_ms,
                f"{side}_tokens_per_s": self.tokens_per_s(), f"{side}_decode_tokens_per_s": self.decode_tokens_per_s()}


class _Round(NamedTuple):
    """One verify round as replay records it."""

    context_len: int
    accepted: int
    committed: int  # tokens it committed to the returned output (drafting/tau.py)
    source: Optional[str]  # hybrid drafting's source, None for other drafters
    predicted: Optional[float]  # the source's expected accepted drafts
    drafted: int
    draft_ms: float
    verify_ms: float
    output_position: int = 0  # output tokens of its turn committed before the round


def output_position_bucket(position: int) -> str:
    return next(name for name, lo, hi in OUTPUT_POSITION_BUCKETS if lo <= position < hi)


def _group(rounds: list, key, first=()) -> dict:
    """The rounds grouped by ``key(round)``: the groups ``first`` (empty or not), then the others
    in order of first appearance."""
    out = {g: [] for g in first}
    for r in rounds:
        out.setdefault(key(r), []).append(r)
    return out


def _tau(rounds: list) -> Optional[float]:
    return tau(sum(r.committed for r in rounds), len(rounds))


def _source_stats(rounds: list, total_rounds: int) -> dict:
    """One drafting source's rounds (hybrid drafting): share, tau, predicted vs actual acceptance."""
    n, predicted, actual = len(rounds), sum(float(r.predicted or 0.0) for r in rounds), sum(r.accepted for r in rounds)
    return {"rounds": n, "committed": sum(r.committed for r in rounds), "predicted_accepted": predicted,
            "actual_accepted": actual, "drafted": sum(r.drafted for r in rounds),
            "rounds_by_context": {b: len(g) for b, g in _group(rounds, lambda r: bucket_of(r.context_len)).items()},
            "share": n / total_rounds, "tau": _tau(rounds),
            "mean_predicted_accepted": predicted / n, "mean_actual_accepted": actual / n}


@dataclass
class ReplayStats:
    num_drafts: int = 0  # the drafter's drafts per round, at most
    conversations: int = 0
    skipped_turns: int = 0
    rounds: list = field(default_factory=list)  # _Round per verify round
    spec: _Side = field(default_factory=_Side)
    ar: _Side = field(default_factory=_Side)
    lossless_compared: int = 0
    lossless_mismatches: int = 0
    mismatch_details: list = field(default_factory=list)
    per_turn: list = field(default_factory=list)
    wall_s: float = 0.0

    def add_spec(self, res):
        self.spec.add(res)
        # accepted + 1 per round, the tokens past the turn's EOS / limit not counted (drafting/tau.py)
        committed = committed_per_round([r.accepted for r in res.rounds], len(res.output_ids))
        self.rounds += [_Round(int(r.context_len), int(r.accepted), k, getattr(r, "source", None),
                               getattr(r, "predicted", None), len(r.draft_tokens), r.draft_ms, r.verify_ms,
                               int(r.context_len) - int(res.prompt_len))
                        for r, k in zip(res.rounds, committed)]

    def compare(self, turn, spec, ar, target) -> bool:
        """Count one lossless comparison of a turn's speculative and target-alone outputs (True: the
        same); for the first few mismatches the details: position, tokens, the target's logit margin."""
        self.lossless_compared += 1
        pos = first_divergence(spec.output_ids, ar.output_ids)
        if pos is None:
            return True
        self.lossless_mismatches += 1
        if len(self.mismatch_details) < MAX_MISMATCH_DETAILS:
            spec_token, ar_token = tokens_at(pos, spec.output_ids, ar.output_ids)
            d = {"conv_id": turn.conv_id, "turn_index": turn.index, "prompt_len": len(turn.prompt_ids),
                 "position": pos, "spec_token": spec_token, "ar_token": ar_token,
                 "spec_len": len(spec.output_ids), "ar_len": len(ar.output_ids)}
            try:
                d.update(_margin(target, list(turn.prompt_ids) + ar.output_ids[:pos]))
            except Exception as exc:  # noqa: BLE001 - diagnostics only
                d["margin_error"] = repr(exc)
            self.mismatch_details.append(d)
        return False

    def to_dict(self) -> dict:
        K, rs, n = self.num_drafts, self.rounds, len(self.rounds)
        by_ctx = _group(rs, lambda r: bucket_of(r.context_len), [name for name, _, _ in CONTEXT_BUCKETS])
        by_pos = _group(rs, lambda r: output_position_bucket(r.output_position),
                        [name for name, _, _ in OUTPUT_POSITION_BUCKETS])
        sources = _group([r for r in rs if r.source is not None], lambda r: r.source)
        by_src = {s: _source_stats(g, n) for s, g in sources.items()}
        reach = [sum(1 for r in rs if r.accepted >= i) for i in range(K + 1)]  # rounds accepting >= i drafts
        spec_tps, ar_tps = self.spec.tokens_per_s(), self.ar.tokens_per_s()
        return {
            "tau": _tau(rs),
            "tau_definition": TAU_DEFINITION,
            "tau_by_context": {b: _tau(g) for b, g in by_ctx.items()},
            "rounds_by_context": {b: len(g) for b, g in by_ctx.items()},
            "tau_by_output_position": {b: _tau(g) for b, g in by_pos.items()},
            "rounds_by_output_position": {b: len(g) for b, g in by_pos.items()},
            "per_position_accept": [reach[i] / n if n else None for i in range(1, K + 1)],
            "per_position_accept_conditional": [reach[i] / reach[i - 1] if reach[i - 1] else None
                                                for i in range(1, K + 1)],
            "num_drafts": K,
            "rounds": n,
            "drafted_tokens_per_round": sum(r.drafted for r in rs) / n if n else None,
            "source_share": {s: d["share"] for s, d in by_src.items()},
            "by_source": by_src,
            "source_share_by_context": {b: {s: sum(r.source == s for r in g) / len(g) for s in by_src}
                                        for b, g in by_ctx.items() if g},
            "conversations": self.conversations,
            "turns": self.spec.turns,
            "skipped_turns": self.skipped_turns,
            "generated_tokens": self.spec.generated,
            "prompt_tokens": self.spec.prompt_tokens,
            "reused_prefix_tokens": self.spec.reused_tokens,
            "draft_ms_per_round": sum(r.draft_ms for r in rs) / n if n else None,
            "verify_ms_per_round": sum(r.verify_ms for r in rs) / n if n else None,
            **self.spec.timings("spec"),
            "ar_turns": self.ar.turns,
            "ar_generated_tokens": self.ar.generated,
            **self.ar.timings("ar"),
            "speedup": (spec_tps / ar_tps) if spec_tps and ar_tps else None,
            "lossless_compared_turns": self.lossless_compared,
            "lossless_mismatches": self.lossless_mismatches,
            "lossless_mismatch_details": self.mismatch_details,
            "wall_s": self.wall_s,
        }


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token (None if equal; the shorter length if one output is a
    prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tokens_at(pos: int, *outputs: Sequence[int]) -> list:
    """Each output's token at ``pos`` (None for an output that ends before it)."""
    return [o[pos] if pos < len(o) else None for o in outputs]


def _margin(target, ids: list) -> dict:
    """Top-2 of the target's next-token logits after ``ids`` (fresh full forward, no cache)."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {"top1": int(top.indices[0]), "top2": int(top.indices[1]),
            "top1_logit": float(top.values[0]), "margin": float(top.values[0] - top.values[1])}


def replay(engine, tokenizer, conversations: list, max_new_tokens: int, *, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0, speculative: bool = True, autoregressive: bool = False,
           check_lossless: bool = False, max_context_tokens: Optional[int] = None,
           progress: bool = False, desc: str = "turns", ar_cache: Optional[ARCache] = None) -> ReplayStats:
    """Replay ``conversations`` (workload records) through ``engine``; see the module docstring.

    ``check_lossless`` (greedy only; implies ``autoregressive``) compares each speculative output
    with the target-alone output token for token; each differing turn counts as one mismatch, with
    details (position, tokens, the target's logit margin there) for the first few.
    """
    greedy = temperature <= 0
    check = bool(check_lossless and greedy)
    autoregressive = autoregressive or check
    stats = ReplayStats(num_drafts=int(engine.drafter.num_drafts) if engine.drafter is not None else 0)
    skip_ids = eos_token_ids(tokenizer, engine.target)
    bar = tqdm(total=sum(count_turns(c) for c in conversations), desc=desc, unit="turn", disable=not progress)
    t0 = time.perf_counter()
    for conv in conversations:
        stats.conversations += 1
        spec_sess = engine.new_session() if speculative else None
        ar_sess = engine.new_session() if autoregressive else None

        def gen(turn):
            s = turn_seed(seed, turn.conv_id, turn.index)
            kw = dict(temperature=temperature, top_p=top_p, seed=s)
            ar_res = sp_res = None
            if autoregressive:
                ck = ar_cache.key(turn.prompt_ids, max_new_tokens, temperature, top_p, s) if ar_cache else None
                ar_res = ar_cache.get(ck) if ck else None
                if ar_res is None:
                    ar_res = engine.generate(turn.prompt_ids, max_new_tokens, session=ar_sess, speculative=False, **kw)
                    if ck:
                        ar_cache.put(ck, ar_res)
                stats.ar.add(ar_res)
            if speculative:
                sp_res = engine.generate(turn.prompt_ids, max_new_tokens, session=spec_sess, speculative=True, **kw)
                stats.add_spec(sp_res)
            rec = {"conv_id": turn.conv_id, "index": turn.index, "prompt_len": len(turn.prompt_ids)}
            if sp_res is not None:
                rec.update(tau=sp_res.tau, rounds=len(sp_res.rounds), generated=len(sp_res.output_ids),
                           reused_prefix=sp_res.reused_prefix)
            if check and sp_res is not None and ar_res is not None:
                rec["lossless_ok"] = stats.compare(turn, sp_res, ar_res, engine.target)
            stats.per_turn.append(rec)
            bar.update(1)
            return (ar_res or sp_res).output_ids

        turns = render_turns(tokenizer, conv, max_context_tokens, max_new_tokens=max_new_tokens,
                             model_limit=engine.max_positions, generate=gen, decode_skip_ids=skip_ids)
        stats.skipped_turns += turns.skipped
        bar.update(turns.skipped)
    stats.wall_s = time.perf_counter() - t0
    bar.close()
    return stats


def evaluate_tau(engine, conversations: list, max_new_tokens: int, tokenizer=None, *,
                 temperature: float = 0.0, seed: int = 0, progress: bool = False) -> dict:
    """Speculative-only replay (no baseline): ``{"tau", "tau_by_context", "per_position_accept",
    "rounds", "generated_tokens", ...}`` (the keys of ``ReplayStats.to_dict``). For periodic
    held-out tau during training, e.g. on ``load_workload("sharegpt-heldout", max_convs=8)``.
    ``tokenizer`` defaults to the one saved with the engine's target (``config._name_or_path``)."""
    if tokenizer is None:
        tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer  # start-up cost: ~2 s, for the one caller without a tokenizer

        tokenizer = AutoTokenizer.from_pretrained(engine.target.config._name_or_path)
    return replay(engine, tokenizer, conversations, max_new_tokens, temperature=temperature, seed=seed,
                  speculative=True, autoregressive=False, progress=progress).to_dict()
