"""Finished conversations of a shard that is still being generated, one file each.

gen-data's fast engine streams the conversations of several claimed shards through one batch and
writes a shard only when its last conversation finishes (long agent/toolchat conversations keep
shards in flight for an hour or more on a CPU). So that a stopped run (kill, crash, the end of a
working period) loses none of them, each finished conversation is written at once to
``<shard>.parts/<index>.pt`` (atomically), with a key of its conversation and of the generation
settings; a later run that claims the shard reads back the parts whose key matches and regenerates
only the rest (the same ids as an uninterrupted run's: each conversation is the target's greedy
text, whatever shares the batch). The folder is removed once the shard is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Dict, Tuple

import torch

from dlite_lab.training.checkpoint import save_checkpoint

# settings that change what a conversation's generated ids or features are
_SETTINGS = ("max_new_tokens", "max_len", "max_user_tokens", "continue_truncated_turns", "dtype", "target")


def parts_dir(out: str, fname: str) -> str:
    return os.path.join(out, fname + ".parts")


def conversation_key(conv, args, layers) -> str:
    """A digest of one conversation + the settings its generation depends on."""
    settings = {k: getattr(args, k, None) for k in _SETTINGS}
    settings["layers"] = list(layers) if layers else None
    blob = json.dumps([conv, settings], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()


def save_part(out: str, fname: str, index: int, key: str, seq, mask, feats, margin: float) -> None:
    d = parts_dir(out, fname)
    os.makedirs(d, exist_ok=True)
    save_checkpoint(os.path.join(d, f"{index:05d}.pt"),  # atomic: a kill mid-write leaves no half part
                    {"key": key, "seq": [int(x) for x in seq], "mask": [int(x) for x in mask],
                     "feats": None if feats is None else feats.contiguous(), "margin": float(margin)})


def load_parts(out: str, fname: str, keys) -> Dict[int, Tuple]:
    """{index: (seq, mask, feats, margin)} of the saved parts whose key matches ``keys[index]``;
    a part with another key, or one that cannot be read, is ignored (and regenerated)."""
    d = parts_dir(out, fname)
    found: Dict[int, Tuple] = {}
    if not os.path.isdir(d):
        return found
    for name in os.listdir(d):
        if not name.endswith(".pt"):
            continue
        try:
            i = int(name[:-3])
            rec = torch.load(os.path.join(d, name), map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged or foreign file: regenerate that conversation
            continue
        if 0 <= i < len(keys) and rec.get("key") == keys[i]:
            found[i] = (rec["seq"], rec["mask"], rec["feats"], rec["margin"])
    return found


def drop_parts(out: str, fname: str) -> None:
    shutil.rmtree(parts_dir(out, fname), ignore_errors=True)
