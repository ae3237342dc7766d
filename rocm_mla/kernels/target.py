"""Where Triton kernels compile to on this machine: HIP (arch, CUs), CUDA (sm, SMs), the CPU
interpreter, or nowhere (and why). Every kernel and the Triton backend ask here.
"""

from __future__ import annotations

import functools
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
