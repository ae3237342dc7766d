"""Backend registry and selection (``ROCM_MLA_BACKEND`` or ``backend=``).

``auto`` picks aiter when it can run the call, else Triton on a GPU, else torch. An explicit
name that cannot run raises with its reasons and the list of what is available.
"""

from __future__ import annotations

import importlib
import os

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import DecodeProblem, DecodeSpec

__all__ = [
    "BACKEND_NAMES",
    "ENV_VAR",
    "Capabilities",
    "MLADecodeImpl",
    "available_backends",
    "backend_class",
    "requested_backend",
    "select_backend",
]

ENV_VAR = "ROCM_MLA_BACKEND"
#: name -> "module:Class", in auto's order of preference. Imported lazily so that neither
#: triton nor aiter is imported until a backend is actually asked for.
_REGISTRY = {
    "aiter": "rocm_mla.backends.aiter:AiterMLAImpl",
    "triton": "rocm_mla.backends.triton:TritonMLAImpl",
    "torch": "rocm_mla.backends.torch_ref:TorchMLAImpl",
}
BACKEND_NAMES = tuple(_REGISTRY)


def backend_class(name: str) -> type[MLADecodeImpl]:
    """The impl class registered under ``name`` (one of ``BACKEND_NAMES``)."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown MLA backend {name!r}; valid names: auto, {', '.join(BACKEND_NAMES)}"
        )
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def available_backends() -> dict[str, str | None]:
    """name -> None if the backend can run on this machine, else why not."""
    return {name: backend_class(name).unavailable_reason() for name in BACKEND_NAMES}


def requested_backend(name: str | None = None) -> str:
    """The backend name asked for: ``name`` if given, else ``$ROCM_MLA_BACKEND``, else auto."""
    source = "backend="
    if name is None:
        name, source = os.environ.get(ENV_VAR, "") or "auto", ENV_VAR
    name = name.strip().lower()
    if name != "auto" and name not in _REGISTRY:
        raise ValueError(
            f"unknown MLA backend {name!r} (from {source}); "
            f"valid names: auto, {', '.join(BACKEND_NAMES)}"
        )
    return name


def select_backend(name: str | None, problem: DecodeSpec | DecodeProblem) -> type[MLADecodeImpl]:
    """Resolve ``name`` (or the env var, or auto) to an impl class that can run ``problem``
    (a whole problem, or the ``DecodeSpec`` of one that ``plan_decode`` is planning)."""
    name = requested_backend(name)
    if name == "auto":
        for candidate in BACKEND_NAMES:
            cls = backend_class(candidate)
            if cls.auto_skip_reason() is None and not cls.unsupported_reasons(problem):
                return cls
        raise ValueError(
            "no MLA backend can run this call: "
            + "; ".join(
                f"{n}: {', '.join(backend_class(n).unsupported_reasons(problem))}"
                for n in BACKEND_NAMES
            )
        )
    cls = backend_class(name)
    reasons = cls.unsupported_reasons(problem)
    if reasons:
        usable = [
            n
            for n in BACKEND_NAMES
            if n != name and not backend_class(n).unsupported_reasons(problem)
        ]
        raise ValueError(
            f"MLA backend {name!r} cannot run this call: {'; '.join(reasons)}. "
            f"Backends that can: {', '.join(usable) or 'none'} "
            f"(set {ENV_VAR} or backend= to one of them, or to auto)"
        )
    return cls
