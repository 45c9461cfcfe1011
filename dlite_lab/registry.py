"""The one drafter registry: every ``--drafter`` spec the reference engine and the benchmarks take.

``dlite[:PATH]``, ``hybrid[:PATH]`` (DLite + suffix lookup in one token tree per round: the tree the
DLITE worker serves, ``served_hybrid``; ``hybrid@nodes=N,branching=head|chain`` other trees of both
sources), ``hybrid-chain[:PATH]`` (the same two sources, one chain per round, chosen per round),
``suffix[:K]`` (the lookup alone), one source's token trees ``dlite-tree`` / ``suffix-tree`` (``@N`` or
``@nodes=N,branching=head|chain``: ``drafting/hybrid.py``), with an opt-in cross-request corpus of
earlier requests (``hybrid@corpus=TOKENS``, ``suffix-tree@corpus=TOKENS``: ``drafting/corpus.py``; off
by default),
``dlite-online[:PATH][@OPTS]`` / ``hybrid-online[:PATH][@OPTS]`` / ``hybrid-chain-online[...]`` (DLite
alone, the served tree or the chain hybrid, drafting from a copy of DLite that learns online from verify
results, ``online.py``; OPTS: ``key=value,...`` of ``OnlineConfig``), or a baseline / ablation name (``baselines/registry.py``: EAGLE-3-, DFlash-,
DSpark-style, n-gram, DLite teacher and windows). Sits above ``drafters.py`` (the interface and
the DLite adapter), ``lookup/`` and ``baselines/``, so none of those imports another's registry.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from dlite_lab.baselines.registry import BASELINE_NAMES, known_drafters_text, make_baseline_drafter
from dlite_lab.ablations import load_drafter
from dlite_lab.reference.drafters import (
    BRANCHINGS, DLiteEngineDrafter, Drafter, HybridEngineDrafter, OnlineDrafter, SuffixEngineDrafter, TreeEngineDrafter,
)
from sglang_dlite.drafting.corpus import SharedCorpus
from sglang_dlite.drafting.hybrid import DEFAULT_TREE_NODES, SERVED_TREE_NODES
from sglang_dlite.drafting.online import OnlineLearner
from sglang_dlite.drafting.online_config import OnlineConfig
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from sglang_dlite.model.checkpoint import read_checkpoint_config

TREE_NAMES = ("dlite-tree", "suffix-tree")  # one source's tree; ``hybrid`` is both sources' tree
# names of earlier releases, refused with what to write instead (kept until the next release)
RENAMED = {"hybrid-tree": "hybrid@branching=head,nodes=24 (the tree with DLite branching at every node; plain "
                          "`hybrid` is the served tree: branching=chain, nodes=15)"}
ONLINE_NAMES = ("dlite-online", "hybrid-online", "hybrid-chain-online")


def make_engine_drafter(spec: str, target) -> Drafter:
    """``--drafter`` specs: ``dlite[:PATH]``, ``hybrid[:PATH]`` (DLite + suffix lookup, a token tree per
    round), ``hybrid-chain[:PATH]`` (a chain per round), ``suffix`` (the lookup alone), a
    baseline/ablation name (``baselines/registry.py``), or a bare checkpoint folder (its config.json's ``model_type`` names the drafter)."""
    name, _, path = spec.partition(":")
    if name.partition("@")[0] in RENAMED:
        raise DLiteInputError(f"--drafter {name.partition('@')[0]} was renamed: use {RENAMED[name.partition('@')[0]]}.")
    if name.partition("@")[0] in TREE_NAMES or name.startswith("hybrid@"):
        return _tree_drafter(name, path, target)
    if name.partition("@")[0] in ONLINE_NAMES:
        return make_online_drafter(spec, target)
    if name not in ("dlite", "hybrid", "hybrid-chain", "suffix") + BASELINE_NAMES and os.path.isdir(spec):
        name, path = _kind_of_folder(spec), spec  # a bare checkpoint folder: its config.json says which drafter
    if name == "dlite":
        return DLiteEngineDrafter(load_drafter(path or None, target))
    if name in ("hybrid", "hybrid-chain"):
        return served_hybrid(DLiteEngineDrafter(load_drafter(path or None, target)), chain=name == "hybrid-chain")
    if name == "suffix":
        return SuffixEngineDrafter(num_drafts=int(path) if path else 7)
    if name in BASELINE_NAMES:
        return make_baseline_drafter(name, path or None, target)
    raise DLiteInputError(f"unknown drafter {spec!r}; known: dlite[:PATH], hybrid[@nodes=N,branching=head|chain,"
                          f"corpus=TOKENS][:PATH], hybrid-chain[:PATH], suffix[:K], dlite-tree[@N][:PATH], suffix-tree[@N], "
                          f"dlite-online[:PATH][@OPTS], hybrid-online[:PATH][@OPTS], hybrid-chain-online[:PATH][@OPTS], "
                          f"{known_drafters_text()}.")


def served_hybrid(dlite: DLiteEngineDrafter, chain: bool = False, corpus: Optional[SharedCorpus] = None):
    """DLITE's default drafting in the reference engine: the token tree the sglang worker drafts
    (the lookup's continuations + DLite's top-k along its greedy chain, ``SERVED_TREE_NODES`` drafts;
    the worker cuts each tree to the rows its cost model pays for), or with ``chain`` the chain
    hybrid (one chain per round from DLite, the lookup or both, ``drafting/chooser.py``: what the worker
    serves where trees are off -- ``tree_max_batch_size`` 0, larger batches, GPUs)."""
    if chain:
        return HybridEngineDrafter(dlite)
    return TreeEngineDrafter(dlite, lookup=True, num_drafts=SERVED_TREE_NODES, branching="chain", corpus=corpus)


def make_online_drafter(spec: str, target) -> OnlineDrafter:
    """``dlite-online[:PATH][@key=value,...]`` / ``hybrid-online[...]`` / ``hybrid-chain-online[...]``:
    DLite alone, in the served tree (``hybrid``) or in the chain hybrid (``hybrid-chain``), drafting
    from a working copy that learns from each verify round (``online.py``; a tree round teaches its
    accepted root path, as the sglang worker's)."""
    head, _, opts = spec.partition("@")
    name, _, path = head.partition(":")
    learner = OnlineLearner(load_drafter(path or None, target), OnlineConfig.parse(opts),
                            drafts_are_model=name == "dlite-online")
    dlite = DLiteEngineDrafter(learner.model)
    inner = dlite if name == "dlite-online" else served_hybrid(dlite, chain=name == "hybrid-chain-online")
    print(f"[{name}] {learner.describe()}", file=sys.stderr)
    return OnlineDrafter(inner, learner)


def _tree_drafter(name: str, path: str, target) -> TreeEngineDrafter:
    """``hybrid@...`` / ``dlite-tree`` / ``suffix-tree``, ``@N`` or ``@nodes=N,branching=head|chain,corpus=T``:
    N tree nodes per round; DLite branching at every node (head) or along its greedy chain (chain,
    what the sglang worker drafts). ``hybrid``'s defaults are the served tree's (15 nodes, chain)."""
    hybrid = name.startswith("hybrid@")
    n, branching, corpus = _tree_options(name, defaults=(SERVED_TREE_NODES, "chain") if hybrid else None)
    name = name.partition("@")[0]
    if name == "suffix-tree":
        if path:
            raise DLiteInputError("--drafter suffix-tree takes no checkpoint (the lookup has no model).")
        return TreeEngineDrafter(None, lookup=True, num_drafts=n, corpus=corpus)
    if corpus is not None and not hybrid:
        raise DLiteInputError(f"--drafter {name}@corpus=...: the corpus branches the suffix lookup's nodes; "
                              "use hybrid@corpus=... or suffix-tree@corpus=....")
    return TreeEngineDrafter(DLiteEngineDrafter(load_drafter(path or None, target)), lookup=hybrid,
                             num_drafts=n, branching=branching, corpus=corpus)


def _tree_options(spec: str, allowed=("nodes", "branching", "corpus"), defaults=None):
    """``NAME@N`` or ``NAME@nodes=N,branching=head|chain,corpus=TOKENS`` -> (N, branching, the
    cross-request corpus: a ``SharedCorpus`` of TOKENS tokens, or None: off, the default);
    ``defaults``: (N, branching) when not given (None: 24 nodes, head)."""
    name, _, opts = spec.partition("@")
    (n, branching), corpus = defaults or (DEFAULT_TREE_NODES, "head"), None
    for opt in filter(None, opts.split(",")):
        key, eq, value = opt.rpartition("=") if "=" in opt else ("nodes", "=", opt)
        if key in allowed and key == "nodes" and value.isdigit() and int(value) > 0:
            n = int(value)
        elif key in allowed and key == "branching" and value in BRANCHINGS:
            branching = value
        elif key in allowed and key == "corpus" and value.isdigit():
            corpus = SharedCorpus(int(value)) if int(value) > 0 else None
        else:
            want = ", ".join({"nodes": "@N or nodes=N (N a positive integer)",
                              "branching": f"branching={'|'.join(BRANCHINGS)}",
                              "corpus": "corpus=TOKENS (the cross-request corpus's token budget; 0: off)"}[k]
                             for k in allowed)
            raise DLiteInputError(f"--drafter {name}@{opts}: {opt!r} is not an option; use {want}.")
    return n, branching, corpus


def _kind_of_folder(path: str) -> str:
    """The drafter name of a checkpoint folder, from its config.json's model_type ("dlite" or
    "dlite-<baseline>", as written by `sglang-dlite train`)."""
    try:
        model_type = read_checkpoint_config(path).get("model_type")
    except DLiteConfigError as exc:
        raise DLiteInputError(f"--drafter {path!r}: a folder, but not a drafter checkpoint ({exc}); pass a "
                              f"folder written by `sglang-dlite train`, or a name: dlite[:PATH], hybrid[:PATH], hybrid-chain[:PATH], "
                              f"suffix[:K], {known_drafters_text()}.") from None
    name = "dlite" if model_type == "dlite" else str(model_type).removeprefix("dlite-")
    if name == "dlite" or name in BASELINE_NAMES:
        return name
    raise DLiteInputError(f"--drafter {path!r}: its config.json has model_type {model_type!r}, not a drafter this "
                          f"package knows; pass NAME:{path} with one of: dlite, {known_drafters_text()}.")
