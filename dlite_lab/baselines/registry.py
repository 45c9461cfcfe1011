"""``--drafter NAME[:PATH]`` for the baselines and DLite's ablations.

Without a path a name loads ``artifacts/baselines/NAME/`` (written by ``make train-baselines``;
git-ignored; ``$SGLANG_DLITE_BASELINES`` overrides the folder); where that is missing, the
checkpoint kept in the lab (``SHIPPED_BASELINES``: EAGLE-3 for the default SmolLM2 target,
so the side-by-side runs on a fresh clone). ``ngram`` needs no checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from sglang_dlite.model.config import DLiteConfig
from dlite_lab.reference.drafters import DLiteEngineDrafter
from sglang_dlite.errors import DLiteConfigError, DLiteInputError
from dlite_lab.ablations import AblationDrafter
from dlite_lab.baselines.dflash import DFlashDrafter, DFlashEngineDrafter, DSparkDrafter
from dlite_lab.baselines.eagle3 import Eagle3Drafter, Eagle3EngineDrafter
from dlite_lab.baselines.ngram import NGramDrafter

DLITE_ABLATIONS = {  # name -> DLiteConfig.history the checkpoint must have
    "dlite-teacher": "full",
    "dlite-window128": "window:128",
    "dlite-window512": "window:512",
    "dlite-single": "none",  # single-stage training: same architecture as DLite
}
KV_BASELINES = ("eagle3", "dflash", "dspark")
BASELINE_NAMES = tuple(DLITE_ABLATIONS) + KV_BASELINES + ("ngram",)
DRAFTER_NAMES = ("dlite",) + BASELINE_NAMES
# name -> folder under dlite_lab/checkpoints/ (bf16, trained on the default target's data)
SHIPPED_BASELINES = {"eagle3": "eagle3-smollm2-135m"}


def known_drafters_text() -> str:
    return ", ".join(f"{n}[:PATH]" if n != "ngram" else n for n in DRAFTER_NAMES)


def baselines_dir() -> str:
    env = os.environ.get("SGLANG_DLITE_BASELINES")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "artifacts", "baselines")


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors"))


def shipped_checkpoint(name: str) -> Optional[str]:
    """The package's own checkpoint for ``name`` (None if it ships none)."""
    folder = SHIPPED_BASELINES.get(name)
    if folder is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", folder)
    return path if _is_checkpoint(path) else None


def default_checkpoint(name: str) -> str:
    """Where ``--drafter NAME`` loads from (and ``python -m dlite_lab.baselines.train
    --drafter-type NAME`` writes to): the trained one in the baselines folder, else the shipped one."""
    trained = os.path.join(baselines_dir(), name)
    if _is_checkpoint(trained):
        return trained
    return shipped_checkpoint(name) or trained


def training_output_dir(name: str) -> str:
    return os.path.join(baselines_dir(), name)


# KV baseline name -> (model class, engine adapter class); the config class is the model's config_class
_KV_CLASSES = {"eagle3": (Eagle3Drafter, Eagle3EngineDrafter), "dflash": (DFlashDrafter, DFlashEngineDrafter),
               "dspark": (DSparkDrafter, DFlashEngineDrafter)}


def model_class(name: str):
    """The model class of a KV baseline name."""
    if name not in KV_BASELINES:
        raise DLiteInputError(f"{name!r} is not a KV baseline; choose one of {', '.join(KV_BASELINES)}.")
    return _KV_CLASSES[name][0]


def new_model(name: str, target_config, seed: Optional[int] = 0, **overrides):
    """A randomly initialized, unbound model for ``name`` sized for a target (training starts here;
    benchmarks of cost use it as is). DLite ablation names return an ``AblationDrafter``."""
    if seed is not None:
        torch.manual_seed(seed)
    if name in DLITE_ABLATIONS or name == "dlite":
        overrides.setdefault("history", DLITE_ABLATIONS.get(name, "none"))
        return AblationDrafter(DLiteConfig.for_target(target_config, **overrides))
    model_cls = model_class(name)
    return model_cls(model_cls.config_class.for_target(target_config, **overrides))


def engine_adapter(name: str, model):
    """Wrap a bound model into the engine's ``Drafter`` protocol."""
    if name in DLITE_ABLATIONS or name == "dlite":
        return DLiteEngineDrafter(model)
    return _KV_CLASSES[name][1](model)


def _missing(name: str, path: str, explicit: bool) -> DLiteConfigError:
    if explicit:
        return DLiteConfigError(f"--drafter {name}:{path}: no checkpoint there (it needs config.json and "
                                "model.safetensors, as written by `python -m dlite_lab.baselines.train "
                                f"--drafter-type {name}`).")
    return DLiteConfigError(
        f"--drafter {name}: no trained checkpoint at {path!r} (the package ships one for "
        f"{', '.join(SHIPPED_BASELINES) or 'none'} only); run `make train-baselines` (or `python -m "
        f"dlite_lab.baselines.train --drafter-type {name} --out {path}`), "
        f"or pass {name}:PATH."
    )


def make_baseline_drafter(name: str, path: Optional[str], target):
    """An engine drafter for a baseline / ablation name, bound to the HF ``target``."""
    if name not in BASELINE_NAMES:
        raise DLiteInputError(f"unknown drafter {name!r}; known: {known_drafters_text()}.")
    if name == "ngram":
        if path:
            raise DLiteInputError("the ngram drafter has no checkpoint: use --drafter ngram (no :PATH).")
        return NGramDrafter()
    if name in DLITE_ABLATIONS:
        path = _checkpoint_path(name, path)
        model = AblationDrafter.from_pretrained(path)
        want = DLITE_ABLATIONS[name]
        if model.config.history != want:
            raise DLiteConfigError(
                f"--drafter {name}: the checkpoint at {path!r} has history={model.config.history!r}, "
                f"but {name} needs history={want!r}."
            )
        return engine_adapter(name, model.bind_hf_target(target))
    return engine_adapter(name, load_kv_baseline(name, path, target))


def load_kv_baseline(name: str, path: Optional[str], target):
    """A KV baseline's model (eagle3 / dflash / dspark) from ``path`` (None: where ``--drafter
    NAME`` loads from), bound to the HF ``target``, in eval mode."""
    return model_class(name).from_pretrained(_checkpoint_path(name, path)).bind_hf_target(target).eval()


def _checkpoint_path(name: str, path: Optional[str]) -> str:
    """``path``, or where ``--drafter NAME`` loads from; a clear error if no checkpoint is there."""
    resolved = path or default_checkpoint(name)
    if not _is_checkpoint(resolved):
        raise _missing(name, resolved, bool(path))
    return resolved
