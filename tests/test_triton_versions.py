"""The Triton releases the decode supports, and the planner's fallbacks inside that range
(issue 36, item 4).

- Below a target's floor (``SUPPORTED_TRITON``) the Triton backend is unavailable and says
  why; ``auto`` takes another backend and ``backend="triton"`` is a ``ValueError``.
- A planned config that the installed Triton cannot compile (sm90 under 3.5.1 / 3.6.0: the
  software pipeliner's MLIR failure) gives way to one that compiles; that one is what the
  plan carries and what the decode launches, and stderr says so once.
- A Triton whose internals the residency compile cannot call (3.4 has no
  ``JITFunction._pack_args``) plans from the estimated residency, said once.

Compiling for sm90 needs no GPU, but this suite runs under the interpreter
(``TRITON_INTERPRET=1``), whose ``@triton.jit`` functions cannot be compiled: the tests that
compile for real run a child process without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton

import rocm_mla
from rocm_mla.backends import available_backends, select_backend
from rocm_mla.backends import triton as triton_backend
from rocm_mla.inputs import DecodeSpec
from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels import occupancy, plan
from rocm_mla.kernels import target as target_module
from rocm_mla.kernels.mla_decode_args import group_config
from rocm_mla.kernels.target import SUPPORTED_TRITON, TritonTarget
from tests.reference import make_paged_problem

ROOT = Path(__file__).resolve().parents[1]
SM90 = TritonTarget("cuda", "sm90", 132)
GFX942 = TritonTarget("hip", "gfx942", 304)
#: What a failing compile reports (``occupancy._compile_failure``'s form).
PASS_FAILURE = "RuntimeError: PassManager::run failed (the compiler's output: /tmp/x.log)"


@pytest.fixture
def fresh_notices(monkeypatch):
    """Every once-only notice may be said again (another test may have said it)."""
    monkeypatch.setattr(target_module, "_SAID", set())


def _on_gpu(monkeypatch, target: TritonTarget, version: str) -> None:
    """The Triton backend sees ``target`` (a GPU tensor is on its platform) and Triton
    reports ``version``."""
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(triton_backend, "_target", lambda: target)
    monkeypatch.setattr(torch.version, "hip", "7.0" if target.backend == "hip" else None)
    # The capabilities are cached per process: recompute them for this target.
    monkeypatch.setattr(triton_backend, "_capabilities", triton_backend._capabilities.__wrapped__)


def _spec(device: str) -> DecodeSpec:
    return DecodeSpec(
        device=torch.device(device),
        q_dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        num_heads=16,
        q_len=1,
        head_dim=576,
        head_dim_v=512,
    )


# ---- the range ---------------------------------------------------------------------------


def test_the_range_is_stated_once_and_named_where_users_look(capsys):
    """One constant; README, docs/architecture.md and ``rocm-mla info`` name it."""
    text = str(SUPPORTED_TRITON)
    assert text == "3.5.1 to 3.9.0, 3.4.0 on gfx942 and gfx950"
    assert SUPPORTED_TRITON.floor(SM90) == (3, 5, 1)
    assert SUPPORTED_TRITON.floor(GFX942) == (3, 4, 0)
    assert SUPPORTED_TRITON.floor(TritonTarget("hip", "gfx90a", 104)) == (3, 5, 1)
    for doc in ("README.md", "docs/architecture.md"):
        assert text in (ROOT / doc).read_text(), doc
    from rocm_mla import cli

    assert cli.main(["info"]) == 0
    assert f"supported: {text}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "version, want",
    [("3.4.0+rocm7.0.0.git1234", (3, 4, 0)), ("3.6.0", (3, 6, 0)), ("3.10", (3, 10, 0))],
)
def test_the_version_is_read_from_triton(monkeypatch, version, want):
    monkeypatch.setattr(triton, "__version__", version)
    assert target_module.triton_version() == want


@pytest.mark.parametrize(
    "target, version, supported",
    [
        (SM90, "3.4.0", False),
        (SM90, "3.5.1", True),
        (SM90, "3.10.0", True),  # newer than checked: allowed
        (GFX942, "3.4.0+rocm7.0.0", True),
        (GFX942, "3.3.1", False),
    ],
    ids=lambda v: str(v),
)
def test_below_the_floor_the_triton_backend_is_unavailable(monkeypatch, target, version, supported):
    """The reason names the installed version and the range; ``auto`` takes torch for a
    call on the GPU (which it would give Triton otherwise) and an explicit ``triton`` is a
    ValueError naming the version."""
    monkeypatch.delenv("ROCM_MLA_BACKEND", raising=False)
    _on_gpu(monkeypatch, target, version)
    spec = _spec("cuda")
    reason = available_backends()["triton"]
    if supported:
        assert reason is None
        assert select_backend(None, spec).name == "triton"
        return
    assert version in reason and str(SUPPORTED_TRITON) in reason
    assert select_backend(None, spec).name == "torch"
    with pytest.raises(ValueError, match=re.escape(f"Triton {version} is older than {target}")):
        select_backend("triton", spec)


def test_below_the_floor_the_public_call_names_the_version(monkeypatch):
    """The interpreter too: ``mla_decode(backend="triton")`` raises before any work."""
    monkeypatch.setattr(triton, "__version__", "3.3.0")
    problem = make_paged_problem([5, 9], num_heads=4)
    with pytest.raises(ValueError, match=r"Triton 3\.3\.0 is older than .* supports \(3\.5\.1\)"):
        rocm_mla.mla_decode(*problem, backend="triton")


def test_plan_launch_refuses_below_the_floor_without_compiling(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled below the floor")

    monkeypatch.setattr(occupancy, "_compiled_stage1_resources", no_compile)
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    with pytest.raises(RuntimeError, match=r"plan_launch: Triton 3\.4\.0 is older than cuda sm90"):
        plan.plan_launch(q_len=1, num_heads=16, kv_dtype=torch.bfloat16, target=SM90)


# ---- a config that does not compile ------------------------------------------------------


def _compiles_only(monkeypatch, accept) -> list:
    """Stage-1 compiles succeed only for configs ``accept`` takes (resources of a small
    kernel), the others fail as an MLIR pass failure reports; returns the configs asked."""
    asked = []

    def compile_(config, backend, arch, **shape):
        asked.append(config)
        if accept(config):
            return {"regs_per_thread": 128, "smem_bytes": 40 << 10}
        return {"compile_error": PASS_FAILURE}

    monkeypatch.setattr(occupancy, "_compiled_stage1_resources", compile_)
    return asked


def test_a_config_that_fails_to_compile_falls_back_and_is_launched(
    monkeypatch, capfd, fresh_notices
):
    """Pipelined configs fail (sm90 under Triton 3.5.1 / 3.6.0): the plan carries the
    one-stage config, the decode launches it (and matches torch), and stderr says so once,
    with the Triton version and the configs."""
    _compiles_only(monkeypatch, lambda c: c.num_stages == 1)
    monkeypatch.setattr(plan, "triton_target", lambda: SM90)
    lengths = [40, 7]
    q, kv, block_table, seqlens = make_paged_problem(lengths, num_heads=16)
    planned = [
        rocm_mla.plan_decode(lengths, q_len=1, num_heads=16, kv_dtype=kv.dtype, backend="triton")
        for _ in range(2)
    ]
    tuned = group_config(kernel.default_config(SM90, num_heads=16, kv_dtype=kv.dtype), 16)
    assert tuned.num_stages > 1
    for p in planned:
        assert p.launch.config == replace(tuned, num_stages=1, shrunk_num_stages=None)
    config, slots = plan.plan_launch(q_len=1, num_heads=16, kv_dtype=kv.dtype)
    assert config == planned[0].launch.config and slots == planned[0].launch.num_slots

    launched = []
    stage1 = kernel._mla_decode_stage1

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs)
                return stage1[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(kernel, "_mla_decode_stage1", Spy())
    out, lse = rocm_mla.mla_decode(q, kv, block_table, seqlens, plan=planned[0])
    assert [(k["num_stages"], k["BLOCK_N"], k["BLOCK_H"]) for k in launched] == [
        (1, config.block_n, config.block_h)
    ]
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, block_table, seqlens, backend="torch")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)

    said = [line for line in capfd.readouterr().err.splitlines() if "rocm_mla:" in line]
    assert len(said) == 1, said
    assert f"Triton {triton.__version__} cannot compile stage 1 for cuda sm90" in said[0]
    assert "PassManager::run failed" in said[0]
    assert f"num_stages={tuned.num_stages}" in said[0]
    assert "with num_stages=1 instead (no software pipelining)" in said[0]


def test_the_fallbacks_go_on_until_one_compiles(monkeypatch, capfd, fresh_notices):
    """A config must give up pipelining, the ids a trip ahead and half its keys per tile
    before it compiles here: each fallback is tried in turn, the first that compiles wins."""
    asked = _compiles_only(monkeypatch, lambda c: c.block_n <= 32 and c.num_stages == 1)
    config, _ = plan.plan_launch(q_len=1, num_heads=16, kv_dtype=torch.bfloat16, target=SM90)
    grouped = asked[0]
    assert grouped.num_stages > 1 and grouped.block_n == 64
    assert (config.num_stages, config.prefetch_ids, config.block_n) == (1, False, 32)
    assert config.block_h == grouped.block_h and config.num_warps == grouped.num_warps
    assert [(c.num_stages, c.prefetch_ids, c.block_n) for c in asked] == [
        (grouped.num_stages, grouped.prefetch_ids, 64),
        (1, grouped.prefetch_ids, 64),
        (1, False, 64),
        (1, False, 32),
    ]
    said = [line for line in capfd.readouterr().err.splitlines() if "rocm_mla:" in line]
    assert len(said) == 1 and "(half the keys per tile)" in said[0], said


def test_no_config_that_compiles_is_refused_by_name(monkeypatch, fresh_notices):
    _compiles_only(monkeypatch, lambda c: False)
    with pytest.raises(RuntimeError) as info:
        plan.plan_launch(q_len=1, num_heads=16, kv_dtype=torch.float8_e4m3fn, target=SM90)
    message = str(info.value)
    assert f"Triton {triton.__version__} cannot compile stage 1 for cuda sm90" in message
    assert "none of its fallbacks (no software pipelining" in message
    assert "16-bit dots) compiles either" in message


def _child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh process without the interpreter (so stage 1 compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.slow
def test_a_real_compile_failure_falls_back_quietly():
    """Through Triton's real compile for sm90: the pipelined config fails as Triton 3.6.0's
    does (its MLIR reproducer on file descriptor 2, then a bare RuntimeError), the one-stage
    config compiles. The user sees one line, not the reproducer, which goes to the file the
    line names."""
    done = _child(
        """
        import os, torch, triton
        from rocm_mla.kernels import plan
        from rocm_mla.kernels.target import TritonTarget

        compile_ = triton.compile

        def pipeliner_fails(src, target=None, options=None):
            if options["num_stages"] > 1:
                os.write(2, b"module { tt.func @_mla_decode_stage1 } // mlir reproducer\\n")
                raise RuntimeError("PassManager::run failed")
            return compile_(src, target=target, options=options)

        triton.compile = pipeliner_fails
        for _ in range(2):
            config, slots = plan.plan_launch(
                q_len=1,
                num_heads=16,
                kv_dtype=torch.float32,
                target=TritonTarget("cuda", "sm90", 132),
            )
            print(config.num_stages, slots)
        """
    )
    assert done.returncode == 0, done.stderr
    runs = done.stdout.split()
    assert runs[0] == runs[2] == "1" and runs[1] == runs[3] and int(runs[1]) >= 132
    assert "mlir reproducer" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "rocm_mla:" in line]
    assert len(said) == 1, done.stderr
    assert f"Triton {triton.__version__} cannot compile stage 1 for cuda sm90" in said[0]
    assert "RuntimeError: PassManager::run failed" in said[0]
    log = re.search(r"the compiler's output: (\S+?)\)", said[0]).group(1)
    assert "mlir reproducer" in Path(log).read_text()
    Path(log).unlink()


@pytest.mark.slow
def test_without_pack_args_the_planner_estimates_and_says_so_once():
    """Triton 3.4's ``JITFunction`` has no ``_pack_args``: the residency compile cannot
    specialize, so the slots come from the estimate, said once however often it plans."""
    done = _child(
        """
        import torch
        from triton.runtime.jit import JITFunction
        from rocm_mla.kernels import occupancy, plan
        from rocm_mla.kernels.target import TritonTarget

        del JITFunction._pack_args
        sm90 = TritonTarget("cuda", "sm90", 132)
        for heads in (16, 128, 16):
            config, slots = plan.plan_launch(
                q_len=1, num_heads=heads, kv_dtype=torch.bfloat16, target=sm90
            )
            estimate = occupancy._estimated_programs_per_cu(
                config, sm90, kv_dtype=torch.bfloat16, head_dim=576, head_dim_v=512
            )
            print(slots == 132 * estimate)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"] * 3
    said = [line for line in done.stderr.splitlines() if "rocm_mla:" in line]
    assert len(said) == 1, done.stderr
    assert f"Triton {triton.__version__} lacks what the planner's residency compile" in said[0]
    assert "_pack_args" in said[0] and "estimated residency" in said[0]
