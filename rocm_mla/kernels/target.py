"""Where Triton kernels compile to on this machine: HIP (arch, CUs), CUDA (sm, SMs), the CPU
interpreter, or nowhere (and why); and which Triton releases the decode supports
(``SUPPORTED_TRITON``). Every kernel and the Triton backend ask here.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass

import torch

from rocm_mla.platform import triton_interpreting


@dataclass(frozen=True)
class TritonTarget:
    """Where Triton kernels compile to on this machine."""

    backend: str  #: "hip", "cuda" or "interpreter"
    arch: str | None  #: "gfx942", "sm90", ...; None for the interpreter
    num_cus: int  #: compute units (AMD) / SMs (NVIDIA); 1 for the interpreter

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
        arch = str(target.arch).split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
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


Version = tuple[int, int, int]


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class TritonRange:
    """The Triton releases the decode is built and checked with, oldest to newest."""

    oldest: Version
    newest: Version
    #: Targets that run on an older release than ``oldest``, and that release.
    older_by_arch: tuple[tuple[str, Version], ...] = ()

    def floor(self, target: TritonTarget) -> Version:
        """The oldest release supported on ``target``."""
        return dict(self.older_by_arch).get(target.arch or "", self.oldest)

    def __str__(self) -> str:
        text = f"{_dotted(self.oldest)} to {_dotted(self.newest)}"
        by_version: dict[Version, list[str]] = {}
        for arch, version in self.older_by_arch:
            by_version.setdefault(version, []).append(arch)
        for version, archs in by_version.items():
            text += f", {_dotted(version)} on {' and '.join(archs)}"
        return text


#: The Triton releases this package supports, the one place that says so (README, ``rocm-mla
#: info`` and docs/architecture.md name it; ``benchmarks/kernel_static.py`` compiles every
#: planned launch under them). Below a target's floor the Triton backend is unavailable.
#: AMD's targets reach back to 3.4.0 because ROCm images carry their own Triton (SGLang's
#: ROCm 7.0 image has 3.4) and the package never installs one over it; sm90 needs 3.5.1.
SUPPORTED_TRITON = TritonRange(
    oldest=(3, 5, 1),
    newest=(3, 9, 0),
    older_by_arch=(("gfx942", (3, 4, 0)), ("gfx950", (3, 4, 0))),
)


def triton_version() -> Version | None:
    """The installed Triton's release (``3.4.0+rocm7.0.0`` -> ``(3, 4, 0)``), or None when
    its version string does not start with one."""
    import triton

    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", triton.__version__)
    if found is None:
        return None
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


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
