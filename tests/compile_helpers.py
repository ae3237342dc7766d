"""Running code that compiles for GPUs from a test session that may have the interpreter on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiler_env() -> dict:
    """This process's environment without ``TRITON_INTERPRET``: under the interpreter the
    ``@triton.jit`` functions are interpreter objects, which cannot be compiled."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def run_compiler(code: str, timeout: float = 600) -> str:
    """Run ``code`` in a fresh Python (same interpreter, PYTHONPATH, cwd the repository) that
    compiles for real; its stdout, or the assertion fails with its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=compiler_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
