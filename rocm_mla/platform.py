"""What machine we are on: cpu / cuda / hip (+ gfx arch), and the versions that matter."""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    kind: str  #: "cpu", "cuda" or "hip"
    arch: str | None  #: "gfx942", "sm90", ... (None on CPU)
    device_name: str | None

    def __str__(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        return f"{self.kind} {self.arch} ({self.device_name})"


@functools.cache
def current_platform() -> Platform:
    """The platform of the current default GPU, or CPU when none is visible."""
    if not torch.cuda.is_available():
        return Platform("cpu", None, None)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if torch.version.hip:
        # gcnArchName looks like "gfx942:sramecc+:xnack-"; the feature flags do not matter here.
        arch = getattr(props, "gcnArchName", "unknown").split(":")[0]
        return Platform("hip", arch, props.name)
    return Platform("cuda", f"sm{props.major}{props.minor}", props.name)


def torch_build() -> str:
    """ "rocm", "cuda" or "cpu": what the installed torch was built for."""
    if torch.version.hip:
        return "rocm"
    if torch.version.cuda:
        return "cuda"
    return "cpu"


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
