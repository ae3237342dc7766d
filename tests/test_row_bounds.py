"""Per-row KV bounds and windows of different lengths, against an fp64 reference (issue 40).

Decode context parallelism (DCP) shards a request's keys over ``N`` ranks in runs of ``I``;
row ``i`` of a causal verify window sees global positions up to ``L - S_q + i``, so on each
rank it sees a count of local keys that is not the last row's minus an offset
(``verify_local_seq_lens``). One decode call takes those bounds (``row_seqlens``), every row
of a window sharing each KV tile load. Here each rank's shard is built from a global paged
cache exactly as the runner's slot mapping lays it out, every rank decodes with its bounds,
and the ranks' partials merged by their LSEs must equal the global fp64 reference. Lengths
shorter than ``N * I`` leave some ranks with no key for some rows (out 0, lse -inf there).

Packed windows of different lengths (``query_start_loc``, as vLLM hands n-gram / MTP / DSpark
drafts) are checked window by window against the same reference, with and without bounds.

Backends: ``torch`` on the CPU runs the fused C++ kernel (``rocm_mla.kernels.cpu_decode``)
where it builds, ``torch-ops`` the same backend with that kernel switched off (its torch ops,
what a GPU or a host without a compiler runs), ``triton`` the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

import rocm_mla
from rocm_mla.backends import torch_ref
from rocm_mla.dcp import verify_local_seq_lens
from rocm_mla.kernels import cpu_decode
from tests.reference import (
    assert_same_attention,
    dcp_shard,
    dense_mla_decode,
    dense_varlen_mla_decode,
    make_paged_problem,
)

BLOCK = 64  # the shards' page size (tests.reference.dcp_shard)
HEADS = 4
#: fp32 on the CPU against fp64: the torch backend's fused attention, the C++ kernel and the
#: Triton interpreter.
TOL = 2e-5
#: bf16 / fp16 q and cache against the same reference: outputs rounded to 8 / 11 bits (the
#: CPU tests' tolerances).
TOL_16 = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
BACKENDS = ["torch", "torch-ops", "triton"]
WORLDS = (2, 4, 8)
INTERLEAVES = (1, 16, 64)


@pytest.fixture(autouse=True)
def _cut_units(monkeypatch):
    """The interpreter has one slot: force more, so that long requests are cut over several
    programs and merged (the packed windows' merge included)."""
    monkeypatch.setenv("ROCM_MLA_TRITON_SLOTS", "5")


@pytest.fixture
def backend(request, monkeypatch):
    """The backend name to call for the parameter ``backend`` (``torch-ops``: the torch
    backend with the C++ kernel switched off)."""
    if request.param == "torch-ops":
        monkeypatch.setattr(torch_ref, "cpu_kernel_unavailable", lambda: "switched off")
        return "torch"
    return request.param


needs_cpu_kernel = pytest.mark.skipif(
    cpu_decode.available() is not None, reason=str(cpu_decode.available())
)


def _window_lengths(backend: str, world: int, interleave: int) -> list[tuple[int, bool]]:
    """``(S_q, causal)`` cases: every one for torch; for the (slow) interpreter two per
    layout, rotating so that the nine layouts cover S_q 1 to 8 both causal and not."""
    every = [(q_len, causal) for q_len in range(1, 9) for causal in (True, False)]
    if backend != "triton":
        return every
    k = WORLDS.index(world) * len(INTERLEAVES) + INTERLEAVES.index(interleave)
    return [every[(2 * k) % 16], every[(2 * k + 9) % 16]]


def _dcp_decode(backend, q, kv, block_table, lengths, world, interleave, causal):
    """Every rank's decode of its shard with per-row bounds, merged by LSE."""
    q_len = q.shape[1]
    outs, lses = [], []
    for rank in range(world):
        shard, table, local = dcp_shard(kv, block_table, lengths, world, rank, interleave)
        if causal:
            rows = verify_local_seq_lens(torch.tensor(lengths), q_len, world, rank, interleave)
        else:
            rows = local[:, None].expand(-1, q_len)
        out, lse = rocm_mla.mla_decode(
            q,
            shard,
            table,
            local,
            causal=causal,
            row_seqlens=rows.to(torch.int32).contiguous(),
            backend=backend,
        )
        outs.append(out)
        lses.append(lse)
    return rocm_mla.merge_states(torch.stack(outs), torch.stack(lses))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("interleave", INTERLEAVES)
@pytest.mark.parametrize("world", WORLDS)
def test_dcp_rows_merge_to_the_global_attention(backend, world, interleave):
    # Ragged lengths: shorter than N * I (ranks without keys), around a run boundary, long.
    lengths = [1, 3, world * interleave - 1, world * interleave + 5, 3 * world * interleave + 7]
    for q_len, causal in _window_lengths(backend, world, interleave):
        q, kv, table, lens = make_paged_problem(
            lengths, num_heads=HEADS, q_len=q_len, block_size=BLOCK, seed=q_len
        )
        out, lse = _dcp_decode(backend, q, kv, table, lengths, world, interleave, causal)
        ref_out, ref_lse = dense_mla_decode(q, kv, table, lens, causal=causal)
        assert_same_attention(out, lse, ref_out.float(), ref_lse.float(), TOL)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_row_bounds_are_each_rows_keys(backend):
    """Any bounds in [0, L], not only DCP's: each row sees exactly its first keys."""
    lengths = [0, 5, 70, 130]
    q, kv, table, lens = make_paged_problem(lengths, num_heads=HEADS, q_len=3, block_size=BLOCK)
    gen = torch.Generator().manual_seed(7)
    rows = torch.stack([torch.randint(0, n + 1, (3,), generator=gen) for n in lengths])
    for causal in (False, True):
        if causal:
            rows = rows.sort(dim=1).values
        got = rocm_mla.mla_decode(
            q, kv, table, lens, causal=causal, row_seqlens=rows.to(torch.int32), backend=backend
        )
        ref = dense_mla_decode(q, kv, table, lens, row_seqlens=rows.tolist())
        assert_same_attention(*got, ref[0].float(), ref[1].float(), TOL)


def _packed(sizes, lengths, seed, dtype=torch.float32):
    q, kv, table, lens = make_paged_problem(
        lengths, num_heads=HEADS, q_len=max(sizes), block_size=BLOCK, seed=seed, dtype=dtype
    )
    packed = torch.cat([q[b, :n] for b, n in enumerate(sizes)])
    qsl = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    return packed, qsl, kv, table, lens


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_windows_of_different_lengths(backend):
    sizes = [4, 1, 1, 4, 2, 8]
    lengths = [40, 1, 300, 3, 65, 129]
    q, qsl, kv, table, lens = _packed(sizes, lengths, seed=3)
    for causal in (True, False):
        out, lse = rocm_mla.mla_decode(
            q, kv, table, lens, causal=causal, query_start_loc=qsl, max_q_len=8, backend=backend
        )
        ref = dense_varlen_mla_decode(q, qsl, kv, table, lens, causal=causal)
        assert out.shape == (q.shape[0], HEADS, 512) and lse.shape == (q.shape[0], HEADS)
        assert_same_attention(out, lse, ref[0].float(), ref[1].float(), TOL)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("interleave", [1, 16])
def test_windows_of_different_lengths_under_dcp(backend, interleave):
    """Ragged windows with per-row DCP bounds: the ranks' merge is the global attention."""
    world, sizes, lengths = 4, [3, 1, 5, 2], [2, 70, 200, 9]
    q, qsl, kv, table, lens = _packed(sizes, lengths, seed=5)
    ref = dense_varlen_mla_decode(q, qsl, kv, table, lens, causal=True)
    outs, lses = [], []
    for rank in range(world):
        shard, local_table, local = dcp_shard(kv, table, lengths, world, rank, interleave)
        rows = torch.cat(
            [
                verify_local_seq_lens(torch.tensor([n]), s, world, rank, interleave)[0]
                for n, s in zip(lengths, sizes, strict=True)
            ]
        )
        out, lse = rocm_mla.mla_decode(
            q,
            shard,
            local_table,
            local,
            query_start_loc=qsl,
            max_q_len=max(sizes),
            row_seqlens=rows.to(torch.int32),
            backend=backend,
        )
        outs.append(out)
        lses.append(lse)
    out, lse = rocm_mla.merge_states(torch.stack(outs), torch.stack(lses))
    assert_same_attention(out, lse, ref[0].float(), ref[1].float(), TOL)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_bounds_and_windows_on_the_cpu_kernel(dtype):
    """bf16 / fp16 q and cache through the C++ kernel: DCP bounds (causal and not, S_q 1 to
    8, lengths shorter than N * I) and ragged packed windows, against the fp64 reference of
    the same 16-bit values."""
    world, interleave = 4, 16
    lengths = [1, 3, world * interleave - 1, world * interleave + 5, 200]
    for q_len in range(1, 9):
        causal = q_len % 2 == 1
        q, kv, table, lens = make_paged_problem(
            lengths, num_heads=HEADS, q_len=q_len, block_size=BLOCK, seed=q_len, dtype=dtype
        )
        out, lse = _dcp_decode("torch", q, kv, table, lengths, world, interleave, causal)
        ref_out, ref_lse = dense_mla_decode(q, kv, table, lens, causal=causal)
        assert_same_attention(out.float(), lse, ref_out.float(), ref_lse.float(), TOL_16[dtype])
    sizes, lengths = [4, 1, 1, 4, 2, 8], [40, 1, 300, 3, 65, 129]
    q, qsl, kv, table, lens = _packed(sizes, lengths, seed=3, dtype=dtype)
    for causal in (True, False):
        out, lse = rocm_mla.mla_decode(
            q, kv, table, lens, causal=causal, query_start_loc=qsl, max_q_len=8, backend="torch"
        )
        assert out.dtype == dtype
        ref = dense_varlen_mla_decode(q, qsl, kv, table, lens, causal=causal)
        assert_same_attention(out.float(), lse, ref[0].float(), ref[1].float(), TOL_16[dtype])


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_cpu_kernel_takes_bounds_and_windows(monkeypatch, threads):
    """On the CPU the torch backend hands per-row bounds and packed windows to the C++
    kernel (no torch-ops detour), and its rows equal the torch ops' to the fp32 tolerance,
    with the windows cut into key chunks (a row whose bound ends before a chunk has no key
    in it) and uncut."""
    calls = []
    real = cpu_decode.decode

    def counting(*args, **kwargs):
        calls.append((kwargs["row_seqlens"] is not None, kwargs["query_start_loc"] is not None))
        return real(*args, **kwargs)

    sizes, lengths = [3, 1, 5, 2], [2, 700, 1200, 9]
    q, qsl, kv, table, lens = _packed(sizes, lengths, seed=11)
    gen = torch.Generator().manual_seed(12)
    rows = torch.cat(
        [torch.randint(0, n + 1, (s,), generator=gen) for n, s in zip(lengths, sizes, strict=True)]
    )
    rows = rows.to(torch.int32)
    kw = {"query_start_loc": qsl, "max_q_len": 5, "causal": False, "backend": "torch"}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setattr(cpu_decode, "decode", counting)
        got = rocm_mla.mla_decode(q, kv, table, lens, row_seqlens=rows, **kw)
        windows = rocm_mla.mla_decode(q, kv, table, lens, **kw)
        assert calls == [(True, True), (False, True)]
        for chunk in (0, 24):
            cut = real(
                q, kv, table, lens, head_dim_v=512, softmax_scale=q.shape[-1] ** -0.5,
                causal=False, row_seqlens=rows, query_start_loc=qsl, max_q_len=5,
                _chunk_keys=chunk,
            )  # fmt: skip
            assert_same_attention(*cut, *got, TOL)
        monkeypatch.setattr(torch_ref, "cpu_kernel_unavailable", lambda: "switched off")
        ops = rocm_mla.mla_decode(q, kv, table, lens, row_seqlens=rows, **kw)
        ops_windows = rocm_mla.mla_decode(q, kv, table, lens, **kw)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2
    assert_same_attention(*got, *ops, TOL)
    assert_same_attention(*windows, *ops_windows, TOL)
    ref = dense_varlen_mla_decode(q, qsl, kv, table, lens, causal=False, row_seqlens=rows.tolist())
    assert_same_attention(*got, ref[0].float(), ref[1].float(), TOL)


@needs_cpu_kernel
def test_the_cpu_kernel_never_reads_past_its_buffers():
    """Called directly (no host checks): bounds past the request and past the block table
    poison their rows alone and set their fault bits; window starts outside q are clamped,
    and a row no window covers is NaN. Nothing is read outside the cache (its unused slots
    are NaN: a stray read would poison the good rows too)."""
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    capacity = 16 * table.shape[1]
    lens = torch.tensor([10, capacity + 50], dtype=torch.int32)  # request 1 past the table
    rows = torch.tensor([[9, 11], [19, capacity + 40]], dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    kw = {"head_dim_v": 512, "softmax_scale": 576**-0.5, "causal": True, "fault_flag": flag}
    out, lse = cpu_decode.decode(q, kv, table, lens, row_seqlens=rows, **kw)
    both = rocm_mla.FAULT_ROW_BOUND | rocm_mla.FAULT_BEYOND_TABLE  # (and the -1 ids past L)
    assert int(flag) & both == both
    nan = torch.tensor([[False, True], [False, True]])
    assert torch.isnan(lse[nan]).all() and torch.isnan(out[nan]).all()
    assert not torch.isnan(lse[~nan]).any() and not torch.isnan(out[~nan]).any()
    ref = dense_mla_decode(q, kv, table, torch.tensor([10, 20]), row_seqlens=[[9, 10], [19, 20]])
    torch.testing.assert_close(out[~nan], ref[0][~nan].float(), atol=TOL, rtol=TOL)

    packed = q.reshape(4, HEADS, -1)
    for starts in ([0, 3, 9], [-5, 2, 2], [0, 4, 4]):
        qsl = torch.tensor(starts, dtype=torch.int32)
        out, lse = cpu_decode.decode(
            packed, kv, table, torch.tensor([10, 20], dtype=torch.int32), query_start_loc=qsl,
            max_q_len=2, **kw,
        )  # fmt: skip
        covered = torch.zeros(4, dtype=torch.bool)
        for b in range(2):
            start = min(max(starts[b], 0), 4)
            end = min(max(starts[b + 1], start), 4)
            covered[start : min(end, start + 2)] = True
        assert torch.isnan(lse[~covered]).all() and not torch.isnan(lse[covered]).any()


# ---- bad input: named errors before any work ---------------------------------------------


@pytest.fixture
def no_kernel(monkeypatch):
    """Refused input must not even reach the C++ kernel."""

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU kernel ran on input the checks refuse")

    monkeypatch.setattr(cpu_decode, "decode", refuse)


def _call(**kw):
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    return rocm_mla.mla_decode(q, kv, table, lens, backend="torch", **kw)


def test_bounds_past_the_request_are_refused(no_kernel):
    rows = torch.tensor([[10, 11], [19, 20]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row_seqlens must be KV bounds in \[0, cache_seqlens\]"):
        _call(row_seqlens=rows)


def test_bounds_past_the_block_table_are_refused(no_kernel):
    # A length past the table's capacity is refused with the bounds inside it.
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    rows = torch.tensor([[9, 10], [19, 20]], dtype=torch.int32)
    lens = torch.tensor([10, 16 * table.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens must be at most the block table"):
        rocm_mla.mla_decode(q, kv, table, lens, row_seqlens=rows, backend="torch")


def test_decreasing_bounds_in_a_causal_window_are_refused(no_kernel):
    rows = torch.tensor([[5, 4], [19, 20]], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing along each causal window"):
        _call(row_seqlens=rows)


def test_bounds_in_any_order_without_causality():
    _call(row_seqlens=torch.tensor([[5, 4], [19, 20]], dtype=torch.int32), causal=False)


@pytest.mark.parametrize(
    ("qsl", "message"),
    [
        ([1, 2, 4], r"window starts from 0 to T = 4"),
        ([0, 0, 4], r"windows of 1 to max_q_len = 3 rows"),
        ([0, 4, 4], r"windows of 1 to max_q_len = 3 rows"),
    ],
)
def test_malformed_window_starts_are_refused(qsl, message, no_kernel):
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    with pytest.raises(ValueError, match=message):
        rocm_mla.mla_decode(
            q.reshape(4, HEADS, -1),
            kv,
            table,
            lens,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            max_q_len=3,
            backend="torch",
        )


def test_shapes_are_named(no_kernel):
    with pytest.raises(ValueError, match=r"row_seqlens must be int32 \[2, 2\]"):
        _call(row_seqlens=torch.zeros(2, 3, dtype=torch.int32))
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    with pytest.raises(ValueError, match=r"q must be 3-D \[T, num_heads, head_dim\]"):
        rocm_mla.mla_decode(
            q, kv, table, lens, query_start_loc=torch.tensor([0, 2, 4]).int(), max_q_len=2
        )
    with pytest.raises(ValueError, match="max_q_len must be the longest window"):
        rocm_mla.mla_decode(
            q.reshape(4, HEADS, -1), kv, table, lens, query_start_loc=torch.tensor([0, 2, 4]).int()
        )


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_planned_call_poisons_rows_whose_bound_leaves_the_request(backend):
    """No host check with a plan: a row whose bound lies past its request is NaN and sets
    FAULT_ROW_BOUND; the other rows are exact and nothing outside the cache is read."""
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    plan = rocm_mla.plan_decode(
        [10, 20], q_len=2, num_heads=HEADS, kv_dtype=kv.dtype, row_bounds=True, backend=backend
    )
    rows = torch.tensor([[9, 10], [19, 21]], dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    out, lse = rocm_mla.mla_decode(q, kv, table, lens, row_seqlens=rows, plan=plan, fault_flag=flag)
    assert int(flag) & rocm_mla.FAULT_ROW_BOUND
    assert torch.isnan(lse[1, 1]).all() and torch.isnan(out[1, 1]).all()
    ref_out, ref_lse = dense_mla_decode(q, kv, table, lens, row_seqlens=[[9, 10], [19, 20]])
    torch.testing.assert_close(out[:, 0], ref_out[:, 0].float(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse[0], ref_lse[0].float(), atol=TOL, rtol=TOL)
    with pytest.raises(rocm_mla.KVBoundsError, match="row_seqlens"):
        rocm_mla.raise_on_fault(flag, "step 1")


def test_a_plan_without_row_bounds_refuses_a_call_with_them(no_kernel):
    q, kv, table, lens = make_paged_problem([10, 20], num_heads=HEADS, q_len=2, block_size=16)
    plan = rocm_mla.plan_decode([10, 20], q_len=2, num_heads=HEADS, kv_dtype=kv.dtype)
    rows = torch.tensor([[9, 10], [19, 20]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row bounds \(row_seqlens\): plan False, call True"):
        rocm_mla.mla_decode(q, kv, table, lens, row_seqlens=rows, plan=plan)
