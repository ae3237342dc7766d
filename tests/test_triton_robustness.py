"""The Triton decode on hostile input: non-finite values and element offsets past 2^31.

NaN/Inf contract: a row that sees a NaN or infinite score (NaN/Inf in its q, a NaN in a
cache element of a key it may see, a softmax scale that overflows) gets out NaN and lse NaN,
never out 0 / lse -inf (which means "no visible key"); rows with no visible key still get
out 0 and lse -inf, and every other row is unaffected. Checked with one slot walking every
unit (stage 1 writes the result) and with the requests 64 keys (one piece) longer over
enough slots that the balanced schedule cuts them (stage 2 merges the poisoned partial).
"""

from __future__ import annotations

import math
import mmap

import pytest
import torch

pytest.importorskip("triton")

import rocm_mla
from rocm_mla.backends.torch_ref import torch_mla_decode
from rocm_mla.backends.triton import TritonMLAImpl
from rocm_mla.inputs import prepare_decode
from rocm_mla.kernels import mla_decode as kernel
from rocm_mla.kernels import mla_decode_args
from rocm_mla.kernels.tuned_configs import LaunchConfig
from tests.reference import assert_same_attention, make_paged_problem
from tests.schedule_helpers import cut_requests, num_groups

# NaN and Inf inputs make the interpreter's numpy warn; they are the point here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:All-NaN slice encountered:RuntimeWarning",
)

if TritonMLAImpl.unavailable_reason() is not None:
    pytest.skip(TritonMLAImpl.unavailable_reason(), allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
#: ``cut=True``: requests this many keys (one piece, 4 pages of 16) longer...
LONGER = 64
#: ...over this many slots: at least one per piece, so every unit of two pieces is cut.
SLOTS = 12
CUT = pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])


#: The same tiles with keys as the dots' M (sm90's fp8 groups under 64 rows).
KEYS_AS_M = LaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, keys_as_m=True)


def slots_for(q, kv, bt, lens, *, cut, config=CONFIG):
    """``SLOTS`` when ``cut`` (every request over one piece is then cut: asserted), else 1."""
    groups = num_groups(heads=q.shape[2], q_len=q.shape[1], kv_dtype=kv.dtype, config=config)
    slots = SLOTS if cut else 1
    long = {b for b, n in enumerate(lens.tolist()) if n > 64}
    got = cut_requests(lens, groups=groups, slots=slots, capacity_keys=bt.shape[1] * kv.shape[1])
    assert got == (long if cut else set()) and (long or not cut)
    return slots


def decode(q, kv, bt, lens, *, cut, softmax_scale=None, config=CONFIG):
    p = prepare_decode(
        q, kv, bt, lens, head_dim_v=512, softmax_scale=softmax_scale, causal=True, kv_scale=None
    )
    return kernel.mla_decode(
        p.q,
        p.kv_cache,
        p.block_table,
        p.cache_seqlens,
        head_dim_v=512,
        softmax_scale=p.softmax_scale,
        num_slots=slots_for(q, kv, bt, lens, cut=cut, config=config),
        config=config,
    )


def problem(seed=0, *, cut=False):
    """Requests of 40, 0 and 23 keys (``cut``: 104, 0 and 87), S_q 2, 16 heads; request 1
    has no visible key."""
    lengths = [n + LONGER * (cut and n > 0) for n in (40, 0, 23)]
    q, kv, bt, lens = make_paged_problem(lengths, num_heads=16, q_len=2, block_size=16, seed=seed)
    return q.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)


def assert_rows(out, lse, poisoned, ref_out, ref_lse):
    """Rows in ``poisoned`` ([B, S_q, H] bool) are all NaN; the others match the reference."""
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(out[poisoned]).all() and torch.isnan(lse[poisoned]).all()
    keep = ~poisoned
    assert_same_attention(out[keep], lse[keep], ref_out.cpu()[keep], ref_lse.cpu()[keep], 1e-5)


@CUT
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_q_poisons_its_row_only(cut, value):
    q, kv, bt, lens = problem(cut=cut)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    q[0, 1, 5, 100] = value  # request 0, position 1, head 5: sees keys
    q[1, 0, 2, 7] = value  # request 1 sees no key: stays empty
    out, lse = decode(q, kv, bt, lens, cut=cut)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[0, 1, 5] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse)
    assert (lse[1].cpu() == -math.inf).all() and (out[1].cpu() == 0).all()


@CUT
@pytest.mark.parametrize("column", [3, 511, 530])  # V part, last V column, rope part
def test_nan_in_a_visible_cache_element_poisons_the_rows_that_see_it(cut, column):
    q, kv, bt, lens = problem(seed=1, cut=cut)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    # Key 10 of request 2 (23 keys; cut, 87, in its first segment): both query positions
    # see it; request 0 does not.
    kv[int(bt[2, 0]), 10, column] = math.nan
    out, lse = decode(q, kv, bt, lens, cut=cut)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[2] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse)


@CUT
def test_an_overflowing_softmax_scale_gives_nan_not_an_empty_row(cut):
    q, kv, bt, lens = problem(seed=2, cut=cut)
    out, lse = decode(q, kv, bt, lens, cut=cut, softmax_scale=1e38)
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(lse[0]).all() and torch.isnan(out[0]).all()
    assert torch.isnan(lse[2]).all() and torch.isnan(out[2]).all()
    assert (lse[1] == -math.inf).all() and (out[1] == 0).all()


@CUT
def test_a_nan_past_a_request_length_is_never_read(cut):
    """Unused slots hold NaN (make_paged_problem fills them): results stay finite."""
    q, kv, bt, lens = problem(seed=3, cut=cut)
    # Keys 40.. of request 0 (cut: 104.., past the end of its second segment): past its length.
    kv[int(bt[0, 2 + 4 * cut]), 8:] = math.nan
    out, lse = decode(q, kv, bt, lens, cut=cut)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    assert_same_attention(out, lse, ref_out, ref_lse, 1e-5)


# ---- 64-bit offsets ---------------------------------------------------------------------------


def sparse_buffer(num_elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor over anonymous memory that is never committed until written.

    MAP_NORESERVE keeps the kernel from reserving the whole size, so a view whose element
    offsets pass 2^31 costs only the pages the test writes.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    buf = mmap.mmap(-1, num_elements * dtype.itemsize, flags=flags)
    return torch.frombuffer(buf, dtype=dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="the sparse host buffer is a CPU tensor")
@CUT
@pytest.mark.parametrize("config", [CONFIG, KEYS_AS_M], ids=["rows-as-m", "keys-as-m"])
def test_views_with_element_offsets_past_2_pow_31_match_torch(cut, config):
    """q's heads and the cache's tokens sit 2^28 elements apart, so head 8+ of q and token
    8+ of every block lie past 2^31 elements (fp16: 4 GiB) from the view's start.

    Each stride alone fits 32 bits (Triton passes it as i32); only index x stride passes
    2^31, which is where 32-bit offset arithmetic wraps.
    """
    q, kv, bt, lens = make_paged_problem(
        [40 + LONGER * cut, 21 + LONGER * cut],
        num_heads=16,
        q_len=2,
        block_size=16,
        dtype=torch.float16,
        seed=4,
    )
    batch, _, heads, dim = q.shape
    num_blocks = kv.shape[0]
    far = 1 << 28
    q_big = sparse_buffer(far * heads, torch.float16).as_strided(
        q.shape, (dim, dim * batch, far, 1)
    )
    q_big.copy_(q)
    kv_big = sparse_buffer(far * kv.shape[1], torch.float16).as_strided(kv.shape, (dim, far, 1))
    kv_big.copy_(kv)
    assert num_blocks * dim < far and (heads - 1) * far > 2**31

    p = prepare_decode(
        q_big, kv_big, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
    )
    assert p.q.stride(2) == far and p.kv_cache.stride(1) == far  # no copy on the way
    out, lse = kernel.mla_decode(
        p.q,
        p.kv_cache,
        p.block_table,
        p.cache_seqlens,
        head_dim_v=512,
        softmax_scale=p.softmax_scale,
        num_slots=slots_for(q, kv, bt, lens, cut=cut, config=config),
        config=config,
    )
    ref = prepare_decode(
        q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
    )
    ref_out, ref_lse = torch_mla_decode(ref)
    assert_same_attention(out, lse, ref_out, ref_lse, 2e-3)


@pytest.mark.skipif(DEVICE != "cpu", reason="the sparse host buffer is a CPU tensor")
def test_merge_partials_past_2_pow_31_elements():
    """Stage-2 style merge where partial n starts at n x 2^30 elements (fp32: 4 GiB apart):
    partial 2 lies past 2^31 elements though the stride fits 32 bits."""
    from rocm_mla.kernels.merge_states import launch_merge
    from rocm_mla.merge import torch_merge_states

    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(3, 5, 64, generator=gen)
    lses = torch.randn(3, 5, generator=gen)
    big = sparse_buffer(2 * (1 << 30) + outs[0].numel(), torch.float32)
    outs_big = big.as_strided(outs.shape, (1 << 30, 64, 1))
    outs_big.copy_(outs)
    out = torch.empty(5, 64)
    lse = torch.empty(5)
    launch_merge(outs_big, lses, out, lse)
    ref_out, ref_lse = torch_merge_states(outs, lses)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("fold_in_branch", "config"),
    [(True, CONFIG), (False, CONFIG), (True, KEYS_AS_M)],
    ids=["branch", "with-dots", "branch-keys-as-m"],
)
@CUT
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize(("key", "seen_from"), [(31, 2), (32, 3), (29, 0), (3, 0)])
def test_a_non_finite_v_element_reaches_only_the_window_queries_that_see_its_key(
    monkeypatch, fold_in_branch, config, cut, value, key, seen_from
):
    """4 heads x S_q 4 in one 16-row group over 16-key tiles: request 0 (33 keys) has its
    window's keys (30-32) in the tail tiles at keys 16 and 32, which drop from P.V the keys
    no row scores finitely; the walk takes keys 0-29, and the first tail tile reads 16-29
    again without seeing them. Query i sees keys below 30 + i. A non-finite V element
    poisons exactly the queries that see its key, whichever loop reads it, with the
    softmax step in a branch (CUDA) or with the dots (AMD), and with keys as the dots' M
    (the tail tiles then have BLOCK_N keys: 16 here, so the same tiles).

    ``cut``: request 0 is 64 keys longer (97) and cut in two segments: the keys past 16
    move by 64 into the second (its tail tiles at 80 and 96), key 3 stays in the first,
    which every query sees whole."""
    dot_types = mla_decode_args._dot_types
    monkeypatch.setattr(
        kernel,  # where mla_decode looks it up
        "_dot_types",
        lambda *args, **kwargs: {**dot_types(*args, **kwargs), "FOLD_IN_BRANCH": fold_in_branch},
    )
    q, kv, bt, lens = make_paged_problem(
        [33 + LONGER * cut, 50], num_heads=4, q_len=4, block_size=16, seed=3
    )
    q, kv, bt, lens = q.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)
    ref_out, ref_lse = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    key += LONGER * (cut and key >= 16)
    kv[int(bt[0, key // 16]), key % 16, 7] = value
    out, lse = decode(q, kv, bt, lens, cut=cut, config=config)
    poisoned = torch.zeros(lse.shape, dtype=torch.bool)
    poisoned[0, seen_from:] = True
    assert_rows(out, lse, poisoned, ref_out, ref_lse)
