"""The fused CPU kernel's first-use build (rocm_mla/kernels/cpu_decode.py): keyed by everything that
makes two builds incompatible, visible on stderr, safe to kill, and bounded for a waiter."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rocm_mla.kernels import cpu_decode

REPO = Path(__file__).resolve().parents[1]

#: One small CPU decode through the torch backend (the fused kernel when it is built), then
#: whether the kernel was available, on stdout.
DECODE = """
import torch, rocm_mla
from rocm_mla.kernels import cpu_decode
g = torch.Generator().manual_seed(0)
q = torch.randn(2, 1, 4, 80, generator=g)
kv = torch.randn(6, 16, 80, generator=g)
bt = torch.arange(6, dtype=torch.int32).view(2, 3)
lens = torch.tensor([40, 7], dtype=torch.int32)
for _ in range(2):
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=64, backend="torch")
assert torch.isfinite(out).all() and torch.isfinite(lse).all()
print("kernel", cpu_decode.available() is None, flush=True)
"""


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(XDG_CACHE_HOME=str(cache), **extra)
    return env


def test_build_key_separates_torch_installs_and_compilers(monkeypatch):
    """Two venvs with the same torch version differ in torch's location (its include paths):
    they get two build directories, not one that each invalidates for the other."""
    here = cpu_decode.build_key()
    assert cpu_decode.build_key() == here
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    other_venv = cpu_decode.build_key()
    assert other_venv != here
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    assert cpu_decode.build_key() != here


def test_the_wait_bound_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_decode.WAIT_ENV, "soon")
    with pytest.raises(ValueError, match=r"ROCM_MLA_CPU_BUILD_WAIT_S must be a number .* 'soon'"):
        cpu_decode._wait_bound()
    monkeypatch.setenv(cpu_decode.WAIT_ENV, "2.5")
    assert cpu_decode._wait_bound() == 2.5


def test_a_waiter_says_so_gives_up_and_decodes_on_the_torch_path(tmp_path, monkeypatch):
    """Another process holds the build lock: the waiter says so on stderr (after
    ``WAIT_NOTICE_S``), gives up after the bound with a named error, warns once, and its
    decodes run the torch path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_dir = cpu_decode._build_dir(cpu_decode.build_key())
    with open(build_dir / "rocm-mla-build.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / cpu_decode._BUILDING).write_text("1\n")  # as a building holder does
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", DECODE],
            env=_env(tmp_path, **{cpu_decode.WAIT_ENV: "3"}),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["kernel", "False"]
    err = done.stderr
    assert (
        f"rocm-mla: waiting for another process's build of the CPU decode kernel in {build_dir}"
        in err
    )
    assert err.count("CpuKernelBuildTimeout") == 1 and err.count("run the torch path") == 1, err
    assert "building the CPU decode kernel" not in err
    assert took < 60


def test_a_waiter_on_a_holder_that_only_loads_says_nothing(tmp_path, monkeypatch):
    """A lock held by a process loading a built kernel (no build marker): the waiter waits
    as long without a word, then gives up the same way."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_dir = cpu_decode._build_dir(cpu_decode.build_key())
    with open(build_dir / "rocm-mla-build.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [sys.executable, "-c", DECODE],
            env=_env(tmp_path, **{cpu_decode.WAIT_ENV: "2"}),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    assert done.returncode == 0 and done.stdout.split() == ["kernel", "False"], done.stderr
    assert "waiting for another process" not in done.stderr
    assert done.stderr.count("CpuKernelBuildTimeout") == 1


@pytest.mark.slow
def test_a_build_killed_mid_compile_does_not_block_the_next(tmp_path):
    """kill -9 of a first-use build (its whole process group, as Ctrl-C takes a pp=2
    engine's workers mid-compile) leaves cpp_extension's ``lock`` baton behind; the next
    process removes it under the OS-held lock, builds, and decodes in bounded time."""
    first = subprocess.Popen(
        [sys.executable, "-c", "from rocm_mla.kernels import cpu_decode; cpu_decode.available()"],
        env=_env(tmp_path),
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        line = first.stderr.readline()
        assert "rocm-mla: building the CPU decode kernel" in line, line
        build_dir = Path(line.rsplit(" in ", 1)[1].strip())
        deadline = time.monotonic() + 60
        while not (build_dir / "lock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (build_dir / "lock").exists()  # cpp_extension's baton: the compile runs
        time.sleep(2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert (build_dir / "lock").exists()  # left behind: the old loader waited on it forever
    assert (build_dir / cpu_decode._BUILDING).exists()
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DECODE],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["kernel", "True"]
    assert "rocm-mla: building the CPU decode kernel" in done.stderr
    assert "rocm-mla: built the CPU decode kernel in" in done.stderr
    assert took < 300
    # Built once: the next process loads it without a word.
    again = subprocess.run(
        [sys.executable, "-c", DECODE],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert again.returncode == 0 and again.stdout.split() == ["kernel", "True"], again.stderr
    assert "rocm-mla:" not in again.stderr


def test_a_failed_build_names_the_compilers_first_error(tmp_path, monkeypatch):
    """A build error's text opens with the compile command (hundreds of characters of
    include paths): the reason and the warning carry the compiler's first ``error:`` line,
    and the build leaves the C++ standard to torch (torch 2.14's headers need C++20 and
    failed under an explicit ``-std=c++17``)."""
    from torch.utils import cpp_extension

    seen = {}

    def failing_load(**kwargs):
        seen.update(kwargs)
        raise RuntimeError(
            "Error building extension 'x': [1/2] c++ -MMD "
            + "-isystem /very/long/path " * 40
            + "\nExpandUtils.h:470:28: error: 'sizes' is not a member of 'at::symint'\n"
            + "ninja: build stopped: subcommand failed."
        )

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    cpu_decode._load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="is not a member of 'at::symint'"):
            module, reason = cpu_decode._load(cpu_decode.NATIVE)
    finally:
        cpu_decode._load.cache_clear()
    assert module is None
    assert "error: 'sizes' is not a member of 'at::symint'" in reason
    assert not any(flag.startswith("-std") for flag in seen["extra_cflags"]), seen
