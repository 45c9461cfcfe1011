"""CPU-ONLY, TEST-ONLY: run ``patch(module)`` the moment a module is imported (or now, if it
already is). Used by the CPU stand-ins in this folder to patch sglang modules lazily, from
``sitecustomize``, without importing sglang at interpreter start-up."""

import importlib.abc
import importlib.util
import sys


class _PostImport(importlib.abc.MetaPathFinder):
    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            self.patch(module)

        loader.exec_module = exec_module
        return spec


def on_import(name: str, patch) -> None:
    """Call ``patch(module)`` once ``name`` is imported (at once if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None:
        patch(mod)
    elif not any(isinstance(f, _PostImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(name, patch))
