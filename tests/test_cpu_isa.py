"""The CPU decode kernel built for each x86 ISA (``$ROCM_MLA_CPU_MARCH``): AVX2 (``x86-64-v3``,
8 floats a vector) and AVX-512 (``x86-64-v4``, 16), each against the float64 reference on
this host when it can run the build; a build it cannot run is still compiled, then skipped
with the reason. And how a march is chosen, keyed and refused."""

from __future__ import annotations

import math
import platform

import pytest
import torch

import rocm_mla
from rocm_mla.kernels import cpu_decode
from tests.reference import dense_mla_decode, dense_varlen_mla_decode, make_paged_problem

#: (march, what ``isa()`` reports for it)
X86_MARCHES = [("x86-64-v3", "avx2 (8 floats"), ("x86-64-v4", "avx512 (16 floats")]
#: fp32 compute over at most a few hundred keys (as tests/test_cpu_decode.py)
TOL_FP32 = 2e-5
#: The flags line of an AVX2-only EPYC (Zen 3) in /proc/cpuinfo, abridged: no AVX-512.
ZEN3_CPUINFO = (
    "flags : fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c "
    "rdrand abm sse4a bmi1 avx2 bmi2 rdseed adx sha_ni"
)

is_x86 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason=f"x86-64 marches need an x86-64 compiler; this host is {platform.machine()}",
)


@pytest.fixture
def fresh_loads():
    """``_load`` and ``unrunnable`` cache per process; a test that fakes what they see
    clears them before and after."""
    cpu_decode._load.cache_clear()
    cpu_decode.unrunnable.cache_clear()
    yield
    cpu_decode._load.cache_clear()
    cpu_decode.unrunnable.cache_clear()


def test_the_march_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv(cpu_decode.MARCH_ENV, raising=False)
    assert cpu_decode.march() == "native"
    monkeypatch.setenv(cpu_decode.MARCH_ENV, "x86-64-v3")
    assert cpu_decode.march() == "x86-64-v3"
    monkeypatch.setenv(cpu_decode.MARCH_ENV, "x86-64-v3 -O0")
    with pytest.raises(ValueError, match=r"ROCM_MLA_CPU_MARCH must be a -march value .*-O0"):
        cpu_decode.march()


def test_each_march_builds_into_its_own_directory(monkeypatch):
    """The march is part of the key; only a native build depends on the CPU it runs on."""
    keys = {m: cpu_decode.build_key(m) for m in ("native", "x86-64-v3", "x86-64-v4")}
    assert len(set(keys.values())) == 3
    monkeypatch.setattr(cpu_decode, "_cpu_info", lambda: "model name : another CPU")
    assert cpu_decode.build_key("native") != keys["native"]
    assert cpu_decode.build_key("x86-64-v3") == keys["x86-64-v3"]


@is_x86
def test_a_march_this_cpu_lacks_is_refused_with_the_missing_features(monkeypatch, fresh_loads):
    """On an AVX2-only host, ``x86-64-v4`` is refused naming the AVX-512 flags it lacks (read
    from the compiler's feature macros, not from a table of march names); the decode then
    runs the torch path with one warning, and the answer is still right."""
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: set(ZEN3_CPUINFO.split(":")[1].split()))
    assert cpu_decode.unrunnable("x86-64-v3") is None
    why = cpu_decode.unrunnable("x86-64-v4")
    assert why is not None and "cannot run -march=x86-64-v4 code: it lacks avx512f" in why
    assert "avx2" not in why.split("lacks", 1)[1]
    assert cpu_decode.unrunnable("native") is None
    monkeypatch.setenv(cpu_decode.MARCH_ENV, "x86-64-v4")
    with pytest.warns(RuntimeWarning, match="lacks avx512f.*run the torch path"):
        assert "the CPU decode kernel is not loaded" in cpu_decode.available()
    with pytest.raises(RuntimeError, match="lacks avx512f"):
        cpu_decode.isa()
    q, kv, bt, lens = make_paged_problem([20, 7], num_heads=4, head_dim=80, seed=1)
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, head_dim_v=64, backend="torch")
    ref_out, ref_lse = dense_mla_decode(q, kv, bt, lens, head_dim_v=64)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL_FP32, rtol=TOL_FP32)
    torch.testing.assert_close(lse.double(), ref_lse, atol=TOL_FP32, rtol=TOL_FP32)


def test_a_march_the_compiler_refuses_is_named(fresh_loads, tmp_path):
    why = cpu_decode.unrunnable("no-such-cpu")
    assert why is not None and "refused -march=no-such-cpu" in why
    with pytest.raises(RuntimeError, match=r"did not compile for -march=no-such-cpu: .*error:"):
        cpu_decode.compile_check("no-such-cpu", tmp_path)


def _close(out, lse, ref_out, ref_lse, tol, rows=None):
    """Rows ``rows`` (bool [B, S_q], default all) equal the reference: the same empty rows
    (out 0, lse -inf), no NaN, values to ``tol``."""
    rows = torch.ones(out.shape[:2], dtype=torch.bool) if rows is None else rows
    out, lse, ref_out, ref_lse = out[rows], lse[rows], ref_out[rows], ref_lse[rows]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (lse[empty] == -math.inf).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=tol, rtol=tol)


def _decode(q, kv, bt, lens, dv, *, kv_scale=None, chunk=None, flag=None):
    out, lse, _ = cpu_decode.decode_with_chunk(
        q,
        kv,
        bt,
        lens,
        head_dim_v=dv,
        softmax_scale=q.shape[-1] ** -0.5,
        causal=True,
        kv_scale=kv_scale,
        max_seqlen=None,
        fault_flag=flag,
        chunk_keys=chunk,
    )
    return out, lse


def _check_kernel(threads: int) -> None:
    """One build against the reference: every cache dtype, 1 to 128 heads (odd counts take
    the one-head pass), verify windows, rows cut into chunks, widths that are no multiple of
    the vector (576/512 and 100/72: the blocked loops' tails), a non-finite key, per-row
    bounds (rows without keys among them) in packed windows of different lengths."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, q_len, d, dv in [(1, 1, 576, 512), (3, 3, 576, 512), (16, 1, 100, 72)]:
            q, kv, bt, lens = make_paged_problem(
                [37, 5, 0, 130], num_heads=heads, q_len=q_len, head_dim=d, seed=heads
            )
            _close(
                *_decode(q, kv, bt, lens, dv),
                *dense_mla_decode(q, kv, bt, lens, head_dim_v=dv),
                TOL_FP32,
            )
        q, kv, bt, lens = make_paged_problem([19, 70], num_heads=128, head_dim=576, seed=2)
        _close(*_decode(q, kv, bt, lens, 512), *dense_mla_decode(q, kv, bt, lens), TOL_FP32)

        for q_dtype, kv_dtype, kv_scale, tol in [
            (torch.float32, torch.bfloat16, None, TOL_FP32),
            (torch.float32, torch.float16, None, TOL_FP32),
            (torch.bfloat16, torch.bfloat16, None, 1e-2),
            (torch.float16, torch.float16, None, 2e-3),
            (torch.float32, torch.float8_e4m3fn, 0.5, TOL_FP32),
        ]:
            q, kv, bt, lens = make_paged_problem(
                [33, 64, 1], num_heads=4, q_len=3, head_dim=576, nan_fill=False, seed=3
            )
            q, kv = q.to(q_dtype), (kv * 0.5).to(kv_dtype)
            out, lse = _decode(q, kv, bt, lens, 512, kv_scale=kv_scale)
            assert out.dtype == q_dtype
            ref = dense_mla_decode(
                q, kv.float() if kv.dtype.itemsize == 1 else kv, bt, lens, kv_scale=kv_scale
            )
            _close(out, lse, *ref, tol)

        q, kv, bt, lens = make_paged_problem([200, 30], num_heads=4, q_len=4, head_dim=576, seed=4)
        clean = kv.clone()
        kv[int(bt[0, 100 // 16]), 100 % 16, 517] = math.inf  # key 100 of request 0
        out, lse = _decode(q, kv, bt, lens, 512, chunk=24)
        nan = torch.zeros(2, 4, dtype=torch.bool)
        nan[0] = True  # its rows see 197..200 keys, all past key 100
        row_nan = torch.isnan(lse).all(-1) & torch.isnan(out).flatten(2).all(-1)
        assert torch.equal(row_nan, nan) and not torch.isnan(out[1]).any()
        _close(out, lse, *dense_mla_decode(q, clean, bt, lens), TOL_FP32, rows=~nan)

        sizes, lengths = [3, 1, 5, 2], [2, 70, 300, 9]
        q, kv, bt, lens = make_paged_problem(lengths, num_heads=5, q_len=5, seed=6)
        packed = torch.cat([q[b, :n] for b, n in enumerate(sizes)])
        qsl = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
        gen = torch.Generator().manual_seed(6)
        bounds = [
            torch.randint(0, n + 1, (k,), generator=gen)
            for n, k in zip(lengths, sizes, strict=True)
        ]
        rows = torch.cat(bounds).to(torch.int32)
        for chunk in (None, 24):
            out, lse, _ = cpu_decode.decode_with_chunk(
                packed, kv, bt, lens, head_dim_v=512, softmax_scale=576**-0.5, causal=False,
                kv_scale=None, max_seqlen=None, fault_flag=None, chunk_keys=chunk,
                row_seqlens=rows, query_start_loc=qsl, max_q_len=5,
            )  # fmt: skip
            ref = dense_varlen_mla_decode(packed, qsl, kv, bt, lens, row_seqlens=rows.tolist())
            _close(out[None], lse[None], ref[0][None], ref[1][None], TOL_FP32)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@is_x86
@pytest.mark.parametrize(("target", "isa"), X86_MARCHES)
def test_each_x86_build_compiles_and_matches_the_reference(target, isa, monkeypatch, tmp_path):
    """Built for ``target`` (its own cache key); where this CPU can run it, its ISA is the
    one asked for and its decodes equal the reference on 1 and 2 threads, also through the
    torch backend. Where it cannot, the source is still compiled for it (no link, no load),
    then the run is skipped with the reason."""
    why = cpu_decode.unrunnable(target)
    if why is not None:
        assert cpu_decode.compile_check(target, tmp_path).stat().st_size > 0
        pytest.skip(f"compiled for -march={target}; not run: {why}")
    monkeypatch.setenv(cpu_decode.MARCH_ENV, target)
    assert cpu_decode.available() is None, cpu_decode.available()
    assert cpu_decode.isa().startswith(isa)
    for threads in (1, 2):
        _check_kernel(threads)
    q, kv, bt, lens = make_paged_problem([30, 12], num_heads=4, head_dim=576, seed=5)
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    _close(out, lse, *dense_mla_decode(q, kv, bt, lens), TOL_FP32)
