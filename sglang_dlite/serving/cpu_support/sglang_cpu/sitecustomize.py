"""CPU-ONLY, TEST-ONLY: runs at start-up of every Python process whose PYTHONPATH holds this
folder (the test fixtures and the CPU demo put it there, for the sglang scheduler subprocesses).

1. Chains to the venv's own torchvision op-schema fix (``cpu_support/torchvision_schemas.py``).
2. Installs the ``torch_native`` TARGET_VERIFY hook (``dlite_cpu_verify_hook``) the moment sglang's
   torch_native attention backend is imported.
3. Installs the bf16 packed-weight linear (``dlite_cpu_packed_linear``: what sglang's AMX path does,
   through oneDNN) the moment sglang's unquantized linear method is imported.
4. Adds the ``torch_native`` backend to sglang's EAGLE draft backends (``dlite_cpu_eagle_draft``:
   sglang's own EAGLE3 worker, chains, beside DLITE in ``bench/e2e.py``) when its factory is imported.
``sgl_kernel`` (the pure-torch stand-in beside this file) is found on the same PYTHONPATH.
"""

import sys

try:  # found through PYTHONPATH: cpu_launch.cpu_environ() puts cpu_support/ right after this folder
    import torchvision_schemas  # noqa: F401
except ImportError:
    pass

try:
    import dlite_cpu_verify_hook

    dlite_cpu_verify_hook.install_lazy()
except Exception as exc:  # never break interpreter start-up
    print(f"[dlite cpu stand-ins] verify hook not installed: {exc}", file=sys.stderr)
try:
    import dlite_cpu_packed_linear

    dlite_cpu_packed_linear.install_lazy()
except Exception as exc:  # never break interpreter start-up
    print(f"[dlite cpu stand-ins] packed linear not installed: {exc}", file=sys.stderr)
try:
    import dlite_cpu_eagle_draft

    dlite_cpu_eagle_draft.install_lazy()
except Exception as exc:  # never break interpreter start-up
    print(f"[dlite cpu stand-ins] EAGLE draft backend not installed: {exc}", file=sys.stderr)
