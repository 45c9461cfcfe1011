"""The drafting vocabulary: the N most frequent tokens of the training data (FR-Spec style).

Greedy drafting ends in a vocabulary projection and an argmax over K positions. For a 49 k
vocabulary that projection is most of the draft step on a CPU (bench/draft_latency.py, bf16, K = 7,
batch 1: the round drops from 10.2 to 4.9 ms with N = 8192) and a large part of it on a GPU. A drafter with a drafting vocabulary
projects onto those N rows of the target's LM head only and maps the argmax back to token ids:
the cost drops ~V/N-fold; a draft can no longer be a token outside the set, which costs
acceptance only where the target emits such a rare token (the verify pass keeps the output
exact either way). The shipped recipe's losses cover the N most frequent tokens too
(``--vocab-subset``; the trainer counts the training split only, this module every shard, so the
two sets can differ at the margin), so the drafter rarely learned to rank anything else highly.

    sglang-dlite draft-vocab --drafter CKPT --data DATA_DIR --size 8192 [--out NEW_CKPT]
"""

from __future__ import annotations

import glob
import os

import numpy as np
import torch
from safetensors import safe_open

from sglang_dlite.errors import DLiteInputError
from dlite_lab.ablations import AblationDrafter


def token_counts(data_dir: str, vocab_size: int) -> np.ndarray:
    """Occurrences of every token id in the data's sequences (``*.npz`` shards, key ``ids``)."""
    files = sorted(glob.glob(os.path.join(data_dir, "*.npz")))
    if not files:
        raise DLiteInputError(f"{data_dir!r} has no *.npz data shards (make them with `sglang-dlite gen-data`).")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for f in files:
        ids = np.load(f)["ids"].reshape(-1).astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DLiteInputError(f"{f!r} holds token ids outside [0, {vocab_size}): data of another target?")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def frequent_token_ids(counts: np.ndarray, n: int) -> torch.Tensor:
    """The n most frequent ids (ties: lower id first), sorted ascending. Ids that never occur are
    included only when fewer than n occur."""
    if not 1 <= n <= len(counts):
        raise DLiteInputError(f"draft vocabulary size {n} must be in [1, {len(counts)}] (the target's vocabulary).")
    order = np.argsort(-counts, kind="stable")[:n]
    return torch.from_numpy(np.sort(order).astype(np.int64))


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Fraction of the data's tokens inside the set."""
    total = counts.sum()
    return float(counts[ids.numpy()].sum() / total) if total else 0.0


def apply(drafter, data_dir: str, n: int) -> str:
    """Give ``drafter`` the drafting vocabulary of the n most frequent tokens of ``data_dir``
    (n = 0: remove it). Returns the model-card line that describes it."""
    if n == 0:
        drafter.set_draft_vocab(None)
        return f"none: drafts over all {drafter.config.vocab_size} tokens"
    counts = token_counts(data_dir, drafter.config.vocab_size)
    ids = frequent_token_ids(counts, n)
    drafter.set_draft_vocab(ids)
    return (f"the {len(ids)} most frequent of {drafter.config.vocab_size} tokens in the training data "
            f"({100 * coverage(counts, ids):.2f} % of its {int(counts.sum())} tokens; "
            f"`sglang-dlite draft-vocab --size {n}`)")


def add_arguments(p) -> None:
    p.add_argument("--drafter", required=True, help="DLite checkpoint folder")
    p.add_argument("--data", required=True, help="training data folder (gen-data shards) to count tokens in")
    p.add_argument("--size", type=int, default=8192, help="tokens in the drafting vocabulary (0: remove it)")
    p.add_argument("--out", default=None, help="write the new checkpoint here (default: in place)")


def run(args) -> int:
    d = AblationDrafter.from_pretrained(args.drafter)
    out = args.out or args.drafter
    saved_dtype = _checkpoint_float_dtype(args.drafter)
    line = apply(d, args.data, args.size)
    card, card_path = None, os.path.join(args.drafter, "README.md")
    if os.path.isfile(card_path):
        with open(card_path) as f:
            card = f.read()
    d.save_pretrained(out, dtype=saved_dtype)
    if card is not None:
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write(with_card_line(card, line))
    print(f"{out}: drafting vocabulary: {line}")
    return 0


CARD_PREFIX = "- Drafting vocabulary: "


def with_card_line(card: str, line: str) -> str:
    """The model card with its drafting-vocabulary line replaced (or appended)."""
    lines = [x for x in card.rstrip("\n").split("\n") if not x.startswith(CARD_PREFIX)]
    return "\n".join(lines + [CARD_PREFIX + line]) + "\n"


def _checkpoint_float_dtype(path: str):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            t = f.get_slice(k).get_dtype()
            if t in ("BF16", "F16", "F32"):
                return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[t]
    return None
