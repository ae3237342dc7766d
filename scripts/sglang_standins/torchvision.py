"""A stand-in ``torchvision`` for the SGLang test venv (scripts/sglang_env.sh installs it as
``torchvision/__init__.py``). Not part of rocm_mla.

SGLang 0.5.23 imports torchvision at module level on paths every text model loads
(``srt/configs`` -> ``srt/multimodal``), and the only torchvision wheels that match its torch
are CUDA builds, which do not import next to the CPU torch. The text paths never call it:
every ``torchvision`` (sub)module imports, every name in it resolves to a placeholder, and
calling or instantiating one raises, naming what was used. ``__version__`` is ``0.0.0``, so
transformers' version checks treat it as too old for its fast image processors.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+rocm-mla-standin"


class _Missing:
    """A torchvision name the stand-in cannot provide; raises when used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: this venv has a torchvision stand-in (scripts/sglang_env.sh), "
            "not torchvision; image models need a real torchvision"
        )


def _module_getattr(module_name: str):
    def __getattr__(attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{module_name}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``torchvision.*`` submodule as an empty package of placeholders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__getattr__ = _module_getattr(module.__name__)


if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())
__getattr__ = _module_getattr(__name__)
