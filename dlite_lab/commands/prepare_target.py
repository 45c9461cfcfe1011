"""`sglang-dlite prepare-target`: the bundled SmolLM2 GGUF -> a plain fp32 HF checkpoint."""

from sglang_dlite.model.bundled_target import default_target_dir, prepare_default_target


def add_arguments(p):
    p.add_argument("--out", default=None, help=f"output folder (default: {default_target_dir()}; "
                   "set SGLANG_DLITE_CACHE to move the cache)")
    p.add_argument("--force", action="store_true", help="convert again even if the folder exists")


def run(args) -> int:
    path = prepare_default_target(out=args.out, force=args.force)
    print(path)
    return 0
