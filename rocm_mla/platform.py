"""What machine we are on: cpu / cuda / hip (+ gfx arch), the versions that matter, and
devices compared as torch places tensors (``resolve_device``, ``same_device``)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
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


def resolve_device(device: torch.device | str | int) -> torch.device:
    """``device`` as torch places a tensor there: ``"cuda"`` without an index is the current
    GPU, ``cuda:<torch.cuda.current_device()>`` (HIP GPUs are ``cuda`` devices in torch too);
    an indexed device (every tensor's) and the CPU stay as they are.

    Read at each call, not cached: ``torch.cuda.set_device`` changes what ``"cuda"`` means.
    With no GPU visible ``"cuda"`` stays unindexed (no tensor can live there to compare with).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_device(a: torch.device | str | int, b: torch.device | str | int) -> bool:
    """Whether ``a`` and ``b`` are one device once resolved (``resolve_device``): ``"cuda"``
    equals ``"cuda:0"`` exactly when GPU 0 is the current one. Every device check of the
    package compares through here; ``torch.device("cuda") == torch.device("cuda:0")`` is False.
    """
    return a == b or resolve_device(a) == resolve_device(b)


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


@dataclass(frozen=True, order=True)
class Release:
    """A package version as far as "is it this release or newer" needs: the first three
    numbers, and whether it is that release itself (or a post-release of it) rather than a
    pre-release (``.devN``, ``aN``, ``bN``, ``rcN``) that may lack its last changes."""

    numbers: tuple[int, int, int]
    final: bool

    def at_least(self, numbers: tuple[int, int, int]) -> bool:
        return self >= Release(numbers, True)

    def __str__(self) -> str:
        return ".".join(map(str, self.numbers)) + ("" if self.final else " (pre-release)")


_RELEASE = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.post\d+)?((?:\.?(?:dev|a|b|rc)\d*)?)")


def parse_release(version: str | None) -> Release | None:
    """``"0.1.7.post2.dev18"`` -> ``Release((0, 1, 7), final=False)``, ``"0.32.0+cpu"`` ->
    ``Release((0, 32, 0), True)``; None for None or a string that starts with no version."""
    found = None if version is None else _RELEASE.match(version.strip())
    if found is None:
        return None
    major, minor, patch, pre = found.groups()
    return Release((int(major), int(minor), int(patch or 0)), final=not pre)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
