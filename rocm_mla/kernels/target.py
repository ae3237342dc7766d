"""Where Triton kernels compile to on this machine: HIP (arch, CUs), CUDA (sm, SMs), the CPU
interpreter, or nowhere (and why); and which Triton releases the decode supports
(``SUPPORTED_TRITON``). Every kernel and the Triton backend ask here.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
from packaging.version import InvalidVersion
from packaging.version import Version as _Release

from rocm_mla.platform import triton_interpreting
from rocm_mla.targets import DEFAULT_TRITON_FLOOR, TARGETS, TargetSpec, Version, target_spec


@dataclass(frozen=True)
class TritonTarget:
    """Where Triton kernels compile to on this machine."""

    backend: str  #: "hip", "cuda" or "interpreter"
    arch: str | None  #: the registry's arch names (``rocm_mla.targets``); None for the interpreter
    num_cus: int  #: compute units (AMD) / SMs (NVIDIA); 1 for the interpreter

    @property
    def spec(self) -> TargetSpec:
        """This target's record in the registry (``rocm_mla.targets.target_spec``)."""
        return target_spec(self.backend, self.arch)

    def __str__(self) -> str:
        if self.backend == "interpreter":
            return "interpreter (CPU, slow, for testing)"
        return f"{self.backend} {self.arch}"


@functools.cache
def _probe() -> tuple[TritonTarget | None, str | None]:
    if triton_interpreting():
        # The interpreter runs one program at a time, so one "compute unit" is the truth.
        return TritonTarget("interpreter", None, 1), None
    from triton.runtime import driver

    try:
        target = driver.active.get_current_target()
    except Exception as exc:
        # With no GPU the active-driver query raises (RuntimeError "0 active drivers" in
        # Triton 3.x); a broken GPU stack raises something else. Either way there is no
        # target, and the reason is kept for the user instead of crashing the caller.
        return None, (
            f"no GPU Triton target ({type(exc).__name__}: {exc}); set TRITON_INTERPRET=1 "
            "before importing triton to run the interpreter on CPU (slow, for testing)"
        )
    if target.backend == "hip":
        # The arch without its feature flags (":sramecc+:xnack-").
        arch = str(target.arch).split(":")[0]
    elif target.backend == "cuda":
        arch = f"sm{target.arch}"
    else:
        return None, f"Triton target backend {target.backend!r} is neither hip nor cuda"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return TritonTarget(target.backend, arch, props.multi_processor_count), None


def triton_target() -> TritonTarget | None:
    """The Triton target of the current device, the interpreter, or None (see the reason)."""
    return _probe()[0]


def triton_target_unavailable_reason() -> str | None:
    """Why there is no Triton target here (None when ``triton_target()`` is not None)."""
    return _probe()[1]


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class TritonRange:
    """The Triton releases the decode is built and checked with, oldest to newest; a target's
    own floor (``TargetSpec.triton_floor`` in the registry) may lie below or above ``oldest``."""

    oldest: Version
    newest: Version

    def floor(self, target: TritonTarget) -> Version:
        """The oldest release supported on ``target``."""
        return target.spec.triton_floor

    def __str__(self) -> str:
        text = f"{_dotted(self.oldest)} to {_dotted(self.newest)}"
        by_version: dict[Version, list[str]] = {}
        for spec in TARGETS.values():
            if spec.triton_floor != self.oldest:
                by_version.setdefault(spec.triton_floor, []).extend(spec.archs)
        for version, archs in by_version.items():
            text += f", {_dotted(version)} on {' and '.join(archs)}"
        return text


#: The Triton releases this package supports, the one place that says so (README, ``rocm-mla
#: info`` and docs/architecture.md name it; ``benchmarks/kernel_static.py`` compiles every
#: planned launch under them). Below a target's floor the Triton backend is unavailable.
SUPPORTED_TRITON = TritonRange(oldest=DEFAULT_TRITON_FLOOR, newest=(3, 9, 0))


def triton_version() -> Version | None:
    """The installed Triton's release (``3.4.0+rocm7.0.0`` -> ``(3, 4, 0)``, ``3.10`` ->
    ``(3, 10, 0)``), or None when its version string is not a PEP 440 version."""
    import triton

    try:
        release = _Release(triton.__version__).release
    except InvalidVersion:
        return None
    major, minor, patch = (*release, 0, 0)[:3]
    return major, minor, patch


def unsupported_triton_reason(target: TritonTarget) -> str | None:
    """Why the installed Triton cannot run the decode on ``target`` (older than its floor in
    ``SUPPORTED_TRITON``), or None. A newer release than the newest checked one is allowed."""
    version = triton_version()
    floor = SUPPORTED_TRITON.floor(target)
    if version is None or version >= floor:
        return None
    import triton

    return (
        f"Triton {triton.__version__} is older than {target} supports ({_dotted(floor)}); "
        f"rocm-mla supports Triton {SUPPORTED_TRITON}: install a torch whose Triton is in that "
        "range, or use another backend"
    )


_SAID: set[object] = set()


def say_once(key: object, message: str) -> None:
    """Print ``message`` on stderr the first time ``key`` comes, never again in this process
    (the planner's fallbacks: one line per distinct cause, however often it plans)."""
    if key in _SAID:
        return
    _SAID.add(key)
    print(message, file=sys.stderr, flush=True)
