"""`sglang-dlite` (also `python -m sglang_dlite`): one console script, one subcommand per job.

Each subcommand lives in the module that owns the job; this file only routes to it. A module
provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sglang_dlite.errors import DLiteError

SUBCOMMANDS = {
    # name: (module, one-line help)
    "prepare-target": ("dlite_lab.commands.prepare_target", "convert the bundled SmolLM2 GGUF into a HF checkpoint (once)"),
    "generate": ("dlite_lab.commands.generate", "speculative generation with the reference engine"),
    "demo": ("dlite_lab.commands.demo", "the main job: the default target + shipped drafter through a real sglang engine"),
    "gen-data": ("dlite_lab.training.gen_data", "regenerate training responses with the target"),
    "train": ("dlite_lab.training.train", "train a drafter (two-stage DLite recipe)"),
    "train-default": ("dlite_lab.training.recipe", "the whole default recipe for the shipped drafter"),
    "draft-vocab": ("dlite_lab.training.draft_vocab", "give a drafter a drafting vocabulary (the data's N most frequent tokens)"),
    "average-drafters": ("dlite_lab.training.average", "weight-average DLite drafters of one lineage (a model soup)"),
    "serve": ("sglang_dlite.serving.serve", "launch an sglang server with --speculative-algorithm DLITE"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-dlite", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    available = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
                continue  # subcommand not part of this build
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        available[name] = mod
    args = parser.parse_args(argv)
    try:
        return int(available[args.command].run(args) or 0)
    except DLiteError as exc:
        print(f"sglang-dlite {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
