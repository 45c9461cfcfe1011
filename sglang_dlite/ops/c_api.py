"""ctypes declarations of the plain C API in ``csrc/cuda/dlite_cuda.h``: the launchers and the
attention launch plan. One place for the header's signatures, used by every program that loads the
kernel library without torch's extension loader: the GPU machine's sanitizer driver
(``bench/gpu_kernel_driver.py``, the nvcc build) and the CPU emulation of the kernels
(``python_tests/kernel_emu.py``, the g++ build of the same file).
"""

from __future__ import annotations

import ctypes

import torch

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # enum DliteDtype

SIGNATURES = {  # name: (restype, argtypes), in the header's order
    "dlite_round_attention_smem_bytes": (_I64, [_I64, _I64]),
    "dlite_round_attention_plan": (_INT, [_I64, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64)]),
    "dlite_assemble_round_inputs_cuda": (_INT, [_INT] + [_PTR] * 6 + [_I64] * 5 + [_F32, _PTR]),
    "dlite_round_attention_cuda": (_INT, [_INT] + [_PTR] * 7 + [_I64] * 7 + [_INT, _PTR]),
    "dlite_lowrank_rnn_scan_cuda": (_INT, [_INT, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR]),
    "dlite_rowwise_argmax_cuda": (_INT, [_INT, _PTR, _PTR, _I64, _I64, _PTR]),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set restype / argtypes of every function of dlite_cuda.h on a loaded library; returns it."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
