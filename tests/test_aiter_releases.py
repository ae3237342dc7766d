"""The aiter backend against real AITER releases' interfaces, on the CPU (issue 43).

Each release is its ``mla_decode_fwd`` signature and split reduce (tests/aiter_interface_model.py):
ROCm/aiter's current source, amd-aiter 0.1.7.post2.dev18 (the one on PyPI) read from its wheel
with ``ast`` (downloaded once into ``~/.cache/rocm-mla``, never imported: importing AITER
needs ROCm), and the tags 0.1.12 and 0.1.16 on either side of the LSE fixes. AITER is made
selectable for CPU tensors on a pretend MI300X, so ``plan_decode`` / ``mla_decode`` select,
plan and call the release's model exactly as on the GPU. Where the release can serve a call
the result equals the torch backend's (bf16: out to 1e-2, a bf16 rounding of the same
attention; the LSE, fp32 in both, to 1e-4); where it cannot, selection refuses it by the
release's name (``auto`` takes another backend, ``backend="aiter"`` is a ValueError), and
no call ever reaches the model with a keyword it lacks (that would be Python's TypeError).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest
import torch

import rocm_mla
from rocm_mla.backends import aiter as aiter_backend
from rocm_mla.backends import available_backends, select_backend
from rocm_mla.backends.aiter import (
    AiterMLAImpl,
    installed_release,
    lse_split_count,
    quantize_per_tensor,
)
from rocm_mla.cli import info_dict, main
from rocm_mla.inputs import DecodeSpec
from tests import aiter_interface_model as model
from tests.reference import make_paged_problem

FP8 = torch.float8_e4m3fnuz  # AITER's fp8 on gfx942, the pretend arch
OUT_TOL, LSE_TOL = 1e-2, 1e-4


@pytest.fixture(scope="module")
def pypi_release():
    return model.pypi_release()


def release_named(name, request):
    return {
        "current": model.CURRENT,
        "0.1.16": model.V0_1_16,
        "0.1.12": model.V0_1_12,
    }.get(name) or request.getfixturevalue("pypi_release")


def pretend_mi300x(monkeypatch, release):
    """A ROCm torch on gfx942 with ``release`` importable, and CPU tensors accepted as the
    GPU's, so selection and planning run as they do there. Returns the release's module."""
    module = model.use_in_backend(monkeypatch, release)
    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: "rocm")
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx942")
    caps = dataclasses.replace(AiterMLAImpl.capabilities, platforms=("hip", "cpu"))
    monkeypatch.setattr(AiterMLAImpl, "capabilities", caps)
    return module


def case(kind, heads, q_len, seed=0):
    """bf16 q over a bf16 or fp8 cache (4 requests, one empty, one shorter than S_q)."""
    lengths = [37, 0, 3, 70]
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=heads, q_len=q_len, block_size=16, seed=seed + heads + q_len
    )
    q, kv = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    if kind == "bf16":
        return q, kv, bt, lens, None
    return q, (kv.float() * 4.0).to(FP8), bt, lens, 0.25


def expected_refusal(release, kind, lse):
    """The start of the reason the release refuses this call with, or None when it serves it."""
    name = f"amd-aiter {release.version}"
    if not lse:
        return None
    if "Final_lse" not in release.reduce_parameters or "return_lse" not in release.names:
        return f"the call needs the LSE (DCP, merge_states) and {name} returns none"
    if release.version in ("0.1.16",):
        return f"the call needs the LSE and {name}'s mla_decode_fwd(return_lse=True) fails"
    if kind == "fp8":
        return f"the call needs the LSE and {name} writes it only in its split reduce"
    return None


def reference(q, kv, bt, lens, kv_scale):
    """The torch backend on the q the aiter backend hands the kernel (per-tensor fp8 for an
    fp8 cache), so the comparison isolates the interface from q's quantization."""
    if kv_scale is not None:
        q_fp8, q_scale = quantize_per_tensor(q, kv.dtype)
        q = (q_fp8.float() * q_scale).to(q.dtype)
    return rocm_mla.mla_decode(q, kv, bt, lens, kv_scale=kv_scale, backend="torch")


def check(out, lse, ref_out, ref_lse, want_lse):
    empty = torch.isinf(ref_lse)
    assert not torch.isnan(out).any() and (out[empty] == 0).all()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_TOL, rtol=OUT_TOL)
    if not want_lse:
        assert lse is None
        return
    assert torch.equal(torch.isinf(lse), empty) and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=LSE_TOL, rtol=LSE_TOL)


@pytest.mark.parametrize("lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", [16, 128, 20])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("name", ["current", "pypi"])
def test_release_serves_or_refuses_by_name(monkeypatch, request, name, kind, heads, q_len, lse):
    release = release_named(name, request)
    pretend_mi300x(monkeypatch, release)
    q, kv, bt, lens, kv_scale = case(kind, heads, q_len)
    plan_args = dict(
        q_len=q_len,
        num_heads=heads,
        kv_dtype=kv.dtype,
        q_dtype=q.dtype,
        device="cpu",
        block_table=bt,
        kv_cache=kv,
        return_lse=lse,
    )
    refusal = expected_refusal(release, kind, lse)
    if refusal is not None:
        for call in (
            lambda: rocm_mla.plan_decode(lens, backend="aiter", **plan_args),
            lambda: rocm_mla.mla_decode(
                q, kv, bt, lens, kv_scale=kv_scale, backend="aiter", return_lse=lse
            ),
        ):
            with pytest.raises(ValueError, match="MLA backend 'aiter' cannot run") as err:
                call()
            assert refusal in str(err.value)
        assert rocm_mla.plan_decode(lens, backend="auto", **plan_args).backend != "aiter"
        return
    ref_out, ref_lse = reference(q, kv, bt, lens, kv_scale)
    plan = rocm_mla.plan_decode(lens, backend="auto", **plan_args)
    assert plan.backend == "aiter"
    check(
        *rocm_mla.mla_decode(q, kv, bt, lens, kv_scale=kv_scale, plan=plan), ref_out, ref_lse, lse
    )
    one_shot = rocm_mla.mla_decode(
        q, kv, bt, lens, kv_scale=kv_scale, backend="aiter", return_lse=lse
    )
    check(*one_shot, ref_out, ref_lse, lse)


def test_pypi_release_as_read_from_its_wheel(monkeypatch, pypi_release):
    assert pypi_release.version == model.PYPI_VERSION
    assert pypi_release.names[: len(model.POSITIONAL)] == model.POSITIONAL
    for missing in ("page_size", "nhead_kv", "return_lse"):
        assert missing not in pypi_release.names
    assert {"sm_scale", "q_scale", "kv_scale", "num_kv_splits"} <= set(pypi_release.names)
    assert "Final_lse" not in pypi_release.reduce_parameters
    # The model takes exactly that signature: the keyword today's call used to pass is
    # Python's own TypeError there, which the matrix above would have met.
    module = pretend_mi300x(monkeypatch, pypi_release)
    assert tuple(inspect.signature(module.mla_decode_fwd).parameters) == pypi_release.names
    with pytest.raises(TypeError, match="page_size"):
        module.mla_decode_fwd(*range(8), page_size=1)
    release = installed_release(aiter_backend._aiter_mla)
    assert release.features() == {
        "page_size/nhead_kv keywords": False,
        "fp8 q_scale/kv_scale": True,
        "return_lse keyword": False,
        "split reduce writes the LSE (aiter#2729)": False,
        "LSE kernel lookup fixed (aiter#4308, 0.1.19)": False,
    }


def test_what_the_pypi_release_can_and_cannot_do_is_stated(monkeypatch, capsys, pypi_release):
    pretend_mi300x(monkeypatch, pypi_release)
    # It can decode (the backend is available), so the limits are in its target line, which
    # `rocm-mla info` prints, and in each refusal.
    assert available_backends()["aiter"] is None
    assert AiterMLAImpl.target() == (
        "hip gfx942 (amd-aiter 0.1.7.post2.dev18: decodes bf16 and fp8 caches, 16 or 128 "
        "kernel heads (fewer padded up); not the LSE (DCP, merge_states))"
    )
    info = info_dict()
    assert info["aiter"]["features"]["return_lse keyword"] is False
    assert info["aiter"]["summary"] == installed_release(aiter_backend._aiter_mla).summary()
    capsys.readouterr()
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    assert "          has: fp8 q_scale/kv_scale; lacks: page_size/nhead_kv keywords, " in printed
    assert "not the LSE (DCP, merge_states)" in printed


@pytest.mark.parametrize("name", ["0.1.12", "0.1.16"])
def test_releases_between_return_lse_and_its_fixes(monkeypatch, request, name):
    """0.1.12 has return_lse but writes no LSE outside persistent mode; 0.1.16 writes it but
    its return_lse=True fails the kernel lookup (the model raises, as AITER does). Both
    decode without the LSE; the backend then asks for none, or the call would fail."""
    release = release_named(name, request)
    pretend_mi300x(monkeypatch, release)
    q, kv, bt, lens, _ = case("bf16", 16, 1)
    with pytest.raises(ValueError, match=re.escape(f"amd-aiter {name}")):
        rocm_mla.mla_decode(q, kv, bt, lens, backend="aiter")
    ref_out, ref_lse = reference(q, kv, bt, lens, None)
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="aiter", return_lse=False)
    check(out, lse, ref_out, ref_lse, False)


@pytest.mark.parametrize(("kind", "heads", "q_len"), [("bf16", 128, 1), ("bf16", 16, 4)])
def test_a_call_that_needs_the_lse_never_launches_one_split(monkeypatch, kind, heads, q_len):
    """Where AITER picks one split per request (a batch that fills the GPU; ``splits = 1``
    here), its reduce is skipped and the LSE comes back unwritten. The plan of a call that
    needs it passes a split count of at least two, so the LSE is the reduce's."""
    module = pretend_mi300x(monkeypatch, model.CURRENT)
    monkeypatch.setattr(module, "splits", 1)
    q, kv, bt, lens, _ = case(kind, heads, q_len)
    plan = rocm_mla.plan_decode(
        lens, q_len=q_len, num_heads=heads, kv_dtype=kv.dtype, device="cpu", backend="aiter"
    )
    assert plan.launch.num_kv_splits >= 2
    ref_out, ref_lse = reference(q, kv, bt, lens, None)
    check(*rocm_mla.mla_decode(q, kv, bt, lens, plan=plan), ref_out, ref_lse, True)
    # What the unforced launch would have returned.
    plain = rocm_mla.plan_decode(
        lens, q_len=q_len, num_heads=heads, kv_dtype=kv.dtype, device="cpu", return_lse=False
    )
    assert plain.backend == "aiter" and plain.launch.num_kv_splits is None
    kernel_heads = aiter_backend.kernel_heads(heads)
    total_q = q.shape[0] * q_len
    _, unwritten = module.mla_decode_fwd(
        torch.zeros(total_q, kernel_heads, 576, dtype=torch.bfloat16),
        kv.flatten(0, 1)[:, None, None, :],
        torch.empty(total_q, kernel_heads, 512, dtype=torch.bfloat16),
        torch.arange(0, total_q + 1, q_len, dtype=torch.int32),
        torch.zeros(q.shape[0] + 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.ones(q.shape[0], dtype=torch.int32),
        q_len,
        return_lse=True,
    )
    assert (unwritten == model.UNWRITTEN).all()


def test_lse_split_count_is_aiters_choice_without_one_split():
    # AITER's own pick for 304 requests of 8K keys on 304 CUs is one split (every CU busy);
    # the LSE needs at least two.
    assert lse_split_count(304, 304 * 8192, 304) >= 2
    for batch, keys in ((1, 100), (64, 64 * 8192), (300, 300 * 2048), (4096, 4096 * 50)):
        chosen = lse_split_count(batch, keys, 304)
        assert 2 <= chosen <= aiter_backend.MAX_SPLITS
    # Small batches spread over many splits, as AITER's heuristic does.
    assert lse_split_count(1, 65536, 304) == aiter_backend.MAX_SPLITS


def test_always_reducing_calls_leave_the_split_count_to_aiter(monkeypatch):
    pretend_mi300x(monkeypatch, model.CURRENT)
    spec = DecodeSpec(
        device=torch.device("cpu"),
        q_dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        num_heads=12,
        q_len=1,
        head_dim=576,
        head_dim_v=512,
    )
    assert select_backend("aiter", spec) is AiterMLAImpl
    launch = AiterMLAImpl.plan_launch(spec, batch=8, max_seqlen=100, total_seqlen=500)
    assert launch.num_kv_splits is None


def test_an_unknown_interface_makes_the_backend_unavailable_by_name(monkeypatch):
    odd = model.ReleaseInterface(
        "0.2.0", (("q", inspect.Parameter.empty), ("kv", inspect.Parameter.empty)), ()
    )
    pretend_mi300x(monkeypatch, odd)
    reason = AiterMLAImpl.unavailable_reason()
    assert reason.startswith("amd-aiter 0.2.0: aiter.mla.mla_decode_fwd(q, kv) is not")
    assert available_backends()["aiter"] == reason
    q, kv, bt, lens, _ = case("bf16", 16, 1)
    with pytest.raises(ValueError, match=re.escape("amd-aiter 0.2.0")):
        rocm_mla.mla_decode(q, kv, bt, lens, backend="aiter")


def test_the_engine_asks_for_the_lse_only_under_dcp(monkeypatch, pypi_release):
    """The runner's single-rank step reads only the output, so the PyPI release serves it;
    a DCP step combines by LSE, so it goes to another backend."""
    from rocm_mla.dcp.layout import plan_step_decode

    pretend_mi300x(monkeypatch, pypi_release)
    step = dict(
        num_heads=16,
        head_dim_v=512,
        rope_dim=64,
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        device="cpu",
    )
    lens = torch.tensor([40, 7], dtype=torch.int32)
    single = plan_step_decode(lens, 1, **step)
    assert (single.backend, single.spec.lse) == ("aiter", False)
    shared = plan_step_decode(lens, 1, dcp_world_size=2, dcp_rank=1, **step)
    assert shared.spec.lse and shared.backend != "aiter"


def test_info_require_aiter_fails_naming_the_release_and_shape(monkeypatch, capsys, request):
    """The docker smoke step: `rocm-mla info --require-aiter` exits 1 for a shape the
    installed AITER would refuse, naming the shape and the release's reason."""
    pretend_mi300x(monkeypatch, request.getfixturevalue("pypi_release"))
    assert main(["info", "--require-aiter", "bf16:16:1,fp8:128:4"]) == 0
    assert "aiter fp8:128:4: serves it" in capsys.readouterr().out
    assert main(["info", "--require-aiter", "bf16:128:1,bf16:128:1:lse"]) == 1
    captured = capsys.readouterr()
    assert "aiter bf16:128:1: serves it" in captured.out
    assert (
        "aiter bf16:128:1:lse: refuses it: the call needs the LSE (DCP, merge_states) and "
        "amd-aiter 0.1.7.post2.dev18 returns none"
    ) in captured.out
    assert "would refuse bf16:128:1:lse (--require-aiter)" in captured.err
    assert main(["info", "--json", "--require-aiter", "bf16:16:2"]) == 0
    assert json.loads(capsys.readouterr().out)["require_aiter"] == {"bf16:16:2": []}
