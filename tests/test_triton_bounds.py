"""The Triton decode given block ids and lengths nobody checked (planned calls, issue 21).

A planned call does no value checks on the host, so the kernel itself must never read
outside ``kv_cache`` or the block table: key ``p`` of request ``b`` is read only if its
column ``p // page_size`` is below ``max_blocks`` and ``block_table[b, col]`` lies in
``[0, num_blocks)``. A query row that may see any other key comes out NaN (out and lse) and
the kernel ORs ``FAULT_BLOCK_ID`` / ``FAULT_BEYOND_TABLE`` into the optional ``fault_flag``;
every other row is exact and the flag is never cleared.

Each check runs twice where it matters: on requests of at most one 64-key piece walked by one
slot (``cut=False``), and on the same requests 64 keys longer over enough slots that the
balanced schedule cuts every unit in two (``cut=True``), so a poisoned segment reaches the
output through stage 2's merge of the partials.

"Never read" is checked for real: the cache and the block table sit between pages that
are mapped with no access, so a read one block before or after the cache, or one column
past the table, kills the process; ids far outside (+-10**6, +-2^31) land in memory that is
not mapped at all.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import rocm_mla
from rocm_mla.backends.triton import TritonMLAImpl
from rocm_mla.inputs import (
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    prepare_decode,
)
from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels.tuned_configs import LaunchConfig
from tests.reference import assert_same_attention, make_paged_problem
from tests.schedule_helpers import cut_requests

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:All-NaN slice encountered:RuntimeWarning",
)

if TritonMLAImpl.unavailable_reason() is not None:
    pytest.skip(TritonMLAImpl.unavailable_reason(), allow_module_level=True)
if not torch.cuda.is_available() and not hasattr(mmap, "MAP_ANONYMOUS"):
    pytest.skip("guard pages need anonymous mmap", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
#: The AMD row-owned shape: block ids loaded one loop trip ahead (another code path).
PREFETCH = LaunchConfig(
    block_h=16, block_n=16, num_warps=1, num_stages=3, rows_per_warp=16, prefetch_ids=True
)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
LENGTHS = [40, 33, 23]  # page 16: 3, 3 and 2 blocks; the table holds 4 columns (capacity 64)
#: ``cut=True``: every request LONGER keys (4 pages) longer, 7, 7 and 6 blocks in a table of 8
#: columns (capacity 128): two pieces each, so a column ``c`` of the short layout is ``c + 4``.
LONGER = 64
#: 3 requests x 2 row groups (S_q 2 x 16 heads, 16-row groups) x 2 pieces: one piece per
#: slot, so the schedule cuts every unit of more than one piece.
SLOTS = 12


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` that ends where a no-access page begins and has another one before.

    The copy starts right after the first guard page when its size is a whole number of
    pages (the caches below are), so a read just before it faults too.
    """
    page = mmap.PAGESIZE
    nbytes = t.numel() * t.element_size()
    pages = -(-nbytes // page)
    buf = mmap.mmap(-1, (pages + 2) * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for addr in (base, base + (pages + 1) * page):
        if libc.mprotect(addr, page, 0) != 0:  # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect failed")
    offset = (pages + 1) * page - nbytes
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    out = flat.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def problem(dtype=torch.float32, seed=0, *, cut=False):
    """Requests of 40, 33 and 23 keys (``cut``: 104, 97 and 87), S_q 2, 16 heads, page 16;
    cache and table guarded."""
    lengths = [n + LONGER * cut for n in LENGTHS]
    q, kv, bt, lens = make_paged_problem(
        lengths, num_heads=16, q_len=2, block_size=16, dtype=dtype, seed=seed, extra_blocks=4
    )
    assert (kv.numel() * kv.element_size()) % mmap.PAGESIZE == 0
    if DEVICE == "cpu":
        return q, guarded(kv), guarded(bt), lens
    return q.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)


def fill_spare_columns(kv, bt, b):
    """Point request ``b``'s unused table columns at unused blocks of finite random keys."""
    spare = [i for i in range(kv.shape[0]) if not (bt == i).any()]
    cols = (bt[b] < 0).nonzero().flatten().tolist()
    gen = torch.Generator().manual_seed(b)
    for col, block in zip(cols, spare, strict=False):
        bt[b, col] = block
        kv[block] = torch.randn(kv[block].shape, generator=gen).to(kv.dtype)
    # Its last used block has NaN past its length: refill that whole block with finite keys.
    used = int((bt[b] >= 0).sum()) - len(cols)
    kv[int(bt[b, used - 1])] = torch.randn(kv[0].shape, generator=gen).to(kv.dtype)
    assert (bt[b] >= 0).all()


def reference(q, kv, bt, lens):
    return rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")


def decode(q, kv, bt, lens, *, cut, flag=True, config=CONFIG):
    """The kernel with no host value check (as a planned call runs it), and its flag.

    ``cut``: over ``SLOTS`` slots, the device planner reading these (unchecked) lengths;
    every request with more than one piece below the table's capacity is cut (asserted).
    Else one slot walks every unit."""
    capacity = bt.shape[1] * kv.shape[1]
    if cut:
        long = {b for b, n in enumerate(lens.tolist()) if min(n, capacity) > 64}
        assert long and cut_requests(lens, groups=2, slots=SLOTS, capacity_keys=capacity) == long
    p = prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=512,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
        check_values=False,
    )
    fault = torch.zeros(1, dtype=torch.int32, device=q.device) if flag else None
    out, lse = kernel.mla_decode(
        p.q,
        p.kv_cache,
        p.block_table,
        p.cache_seqlens,
        head_dim_v=512,
        softmax_scale=p.softmax_scale,
        num_slots=SLOTS if cut else 1,
        config=config,
        fault_flag=fault,
    )
    return out.cpu(), lse.cpu(), None if fault is None else int(fault.cpu()[0])


def assert_rows(out, lse, poisoned, ref_out, ref_lse, tol):
    """Rows in ``poisoned`` ([B, S_q, H] bool) are all NaN; the others match the reference."""
    assert torch.isnan(out[poisoned]).all() and torch.isnan(lse[poisoned]).all()
    keep = ~poisoned
    assert_same_attention(out[keep], lse[keep], ref_out.cpu()[keep], ref_lse.cpu()[keep], tol)


BAD_IDS = [-1, "num_blocks", 10**6, -(10**6), INT32_MAX, INT32_MIN, "num_blocks+1"]


def bad_id(value, num_blocks):
    return {"num_blocks": num_blocks, "num_blocks+1": num_blocks + 1}.get(value, value)


CUT = pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])


@pytest.mark.parametrize("config", [CONFIG, PREFETCH], ids=["plain", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@CUT
@pytest.mark.parametrize("value", BAD_IDS)
def test_an_out_of_range_block_id_is_never_read_and_poisons_the_rows_that_see_it(
    value, cut, dtype, config
):
    q, kv, bt, lens = problem(dtype, seed=1, cut=cut)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    # Keys 16..31 of request 2 (the table's last row); cut, in its first segment of two.
    bt[2, 1] = bad_id(value, kv.shape[0])
    out, lse, fault = decode(q, kv, bt, lens, cut=cut, config=config)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[2] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse, TOL[dtype])
    assert fault == FAULT_BLOCK_ID


@pytest.mark.parametrize("fill", [math.nan, math.inf])
@CUT
def test_a_bad_block_only_the_later_query_sees_poisons_only_that_query(cut, fill):
    """Request 1 has 33 keys: query 0 sees keys 0..31, query 1 also key 32 (column 2); cut,
    97 keys, the same in its second segment (keys 64..96, column 6).

    Whatever the kernel reads in place of the bad block (the cache's last one, here all
    NaN or Inf) must not reach query 0, which gives that key weight 0."""
    q, kv, bt, lens = problem(seed=2, cut=cut)
    last = kv.shape[0] - 1
    spare = next(i for i in range(last) if not (bt == i).any())
    if (bt == last).any():  # move the last block's keys to a spare block
        kv[spare] = kv[last]
        bt[bt == last] = spare
    kv[last] = fill
    ref_out, ref_lse = reference(q, kv, bt, lens)
    bt[1, 2 + 4 * cut] = -1
    out, lse, fault = decode(q, kv, bt, lens, cut=cut)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[1, 1] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse, 1e-5)
    assert fault == FAULT_BLOCK_ID


@CUT
def test_bad_block_ids_past_the_length_are_no_fault(cut):
    q, kv, bt, lens = problem(seed=3, cut=cut)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    shift = 4 * cut
    bt[0, 3 + shift] = 10**6  # request 0 uses columns 0..2 (cut: 0..6)
    bt[2, 2 + shift :] = INT32_MIN  # request 2 uses columns 0..1 (cut: 0..5)
    out, lse, fault = decode(q, kv, bt, lens, cut=cut)
    assert_same_attention(out, lse, ref_out.cpu(), ref_lse.cpu(), 1e-5)
    assert fault == 0


@pytest.mark.parametrize("config", [CONFIG, PREFETCH], ids=["plain", "prefetch"])
@CUT
@pytest.mark.parametrize("length", ["capacity+2", 1000, 10**6, INT32_MAX])
def test_lengths_past_the_table_poison_their_request_and_nothing_else(length, cut, config):
    """Capacity 64 (cut: 128): with a length of capacity + 2 or more both queries of
    request 2 may see past it (cut: the schedule plans its keys up to the capacity, two
    pieces)."""
    q, kv, bt, lens = problem(seed=4, cut=cut)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    fill_spare_columns(kv, bt, 2)  # finite keys up to the capacity: only the length is bad
    capacity = bt.shape[1] * kv.shape[1]
    lens[2] = capacity + 2 if length == "capacity+2" else length
    out, lse, fault = decode(q, kv, bt, lens, cut=cut, config=config)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[2] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse, 1e-5)
    assert fault == FAULT_BEYOND_TABLE


@CUT
def test_one_key_past_the_table_poisons_only_the_query_that_sees_it(cut):
    """Length 65 at capacity 64 (cut: 129 at 128): query 0 sees keys 0..63 (all readable),
    query 1 key 64 too. Query 0 then equals query 1 of a 64-key request with the same q row."""
    q, kv, bt, lens = problem(seed=5, cut=cut)
    fill_spare_columns(kv, bt, 2)
    capacity = bt.shape[1] * kv.shape[1]
    lens_full = lens.clone()
    lens_full[2] = capacity
    q_shift = q.clone()
    q_shift[2, 1] = q[2, 0]
    ref_out, ref_lse = reference(q_shift, kv, bt, lens_full)
    lens[2] = capacity + 1
    out, lse, fault = decode(q, kv, bt, lens, cut=cut)
    assert torch.isnan(out[2, 1]).all() and torch.isnan(lse[2, 1]).all()
    assert_same_attention(out[2, 0], lse[2, 0], ref_out[2, 1], ref_lse[2, 1], 1e-5)
    assert fault == FAULT_BEYOND_TABLE


@pytest.mark.parametrize("length", [-1, INT32_MIN])
def test_negative_lengths_are_a_fault_and_read_nothing(length):
    """Request 0 plans no piece (its rows are NaN, FAULT_NEGATIVE_LENGTH); the other two are
    cut."""
    q, kv, bt, lens = problem(seed=6, cut=True)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    lens[0] = length
    bt[0] = INT32_MIN  # never looked at: no key is visible
    out, lse, fault = decode(q, kv, bt, lens, cut=True)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert_same_attention(out[1:], lse[1:], ref_out[1:].cpu(), ref_lse[1:].cpu(), 1e-5)
    assert fault == FAULT_NEGATIVE_LENGTH


def test_both_faults_are_ored_into_a_flag_that_is_never_cleared():
    """Through cut units: each of their segments ORs its own faults in."""
    q, kv, bt, lens = problem(seed=7, cut=True)
    bt[0, 1] = -5
    lens[1] = 1000
    p = prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=512,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
        check_values=False,
    )
    flag = torch.full((1,), FAULT_BEYOND_PLAN, dtype=torch.int32, device=q.device)
    capacity = bt.shape[1] * kv.shape[1]
    assert cut_requests(lens, groups=2, slots=SLOTS, capacity_keys=capacity) == {0, 1, 2}
    kernel.mla_decode(
        p.q,
        p.kv_cache,
        p.block_table,
        p.cache_seqlens,
        head_dim_v=512,
        softmax_scale=p.softmax_scale,
        num_slots=SLOTS,
        config=CONFIG,
        fault_flag=flag,
    )
    assert int(flag.cpu()[0]) == FAULT_BEYOND_PLAN | FAULT_BLOCK_ID | FAULT_BEYOND_TABLE


def test_without_a_flag_the_rows_are_still_poisoned():
    q, kv, bt, lens = problem(seed=8)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    bt[0, 0] = 10**6
    out, lse, fault = decode(q, kv, bt, lens, cut=False, flag=False)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[0] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse, 1e-5)
    assert fault is None


@pytest.mark.parametrize(
    "flag",
    [
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros((), dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32, device="meta"),
        [0],
    ],
)
def test_a_malformed_flag_is_refused_by_name(flag):
    q, kv, bt, lens = problem(seed=9)
    with pytest.raises(ValueError, match="fault_flag must be an int32 tensor of shape"):
        kernel.mla_decode(
            q,
            kv,
            bt,
            lens,
            head_dim_v=512,
            softmax_scale=0.1,
            num_slots=1,
            config=CONFIG,
            fault_flag=flag,
        )


def test_the_planned_backend_call_passes_the_problem_flag_and_one_shot_still_refuses():
    """The backend forced to ``SLOTS`` slots cuts every request; the plan's own schedule
    (the target's slots) and the one-shot call run alongside."""
    q, kv, bt, lens = problem(seed=10, cut=True)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    plan = rocm_mla.plan_decode(
        lens,
        q_len=2,
        num_heads=16,
        kv_dtype=kv.dtype,
        q_dtype=q.dtype,
        device=q.device,
        backend="triton",
    )
    bt[0, 2] = kv.shape[0]
    capacity = bt.shape[1] * kv.shape[1]
    assert cut_requests(lens, groups=2, slots=SLOTS, capacity_keys=capacity) == {0, 1, 2}
    impl = TritonMLAImpl(num_heads=16, head_dim_v=512, rope_dim=64, num_slots=SLOTS)
    problem_ = prepare_decode(
        q,
        kv,
        bt,
        lens,
        head_dim_v=512,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
        check_values=False,
    )
    flag = torch.zeros(1, dtype=torch.int32, device=q.device)
    out, lse = impl.run(replace(problem_, fault_flag=flag), plan)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[0] = True
    assert_rows(out.cpu(), lse.cpu(), poisoned, ref_out, ref_lse, 1e-5)
    assert int(flag.cpu()[0]) == FAULT_BLOCK_ID
    # The planned public call (no flag) poisons the same rows; the one-shot call refuses.
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)
    assert_rows(out.cpu(), lse.cpu(), poisoned, ref_out, ref_lse, 1e-5)
    with pytest.raises(ValueError, match="block_table"):
        rocm_mla.mla_decode(q, kv, bt, lens, backend="triton")
