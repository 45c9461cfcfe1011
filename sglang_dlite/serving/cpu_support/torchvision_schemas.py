"""Define torchvision's op schemas so PyPI's (CUDA) torchvision imports beside CPU torch.

Loaded by a .pth file in the project's CPU virtualenv only (``make`` writes it). It costs nothing
at start-up: a meta-path hook defines the two schemas the first time ``torchvision`` is imported
(transformers and sglang both import it), then steps aside.
"""

import sys

_LIB = None


def define_schemas() -> None:
    global _LIB
    import torch

    try:
        _LIB = torch.library.Library("torchvision", "DEF")
        _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # already defined (a matching torchvision build, or a second call)
        pass


class _TorchvisionHook:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_schemas()
        return None


if not any(isinstance(h, _TorchvisionHook) for h in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionHook())
