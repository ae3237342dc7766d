"""The Triton LSE merge against ``torch_merge_states`` (the definition of the operation)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import rocm_mla
from rocm_mla.kernels.merge_states import launch_merge, launch_merge_pieces, merge_states
from rocm_mla.kernels.target import TritonTarget, triton_target
from rocm_mla.merge import torch_merge_states
from tests.reference import assert_same_attention

if triton_target() is None:
    pytest.skip("no Triton target (GPU or TRITON_INTERPRET=1)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_partials(num_parts, rows, head_dim_v, *, dtype=torch.float32, seed=0):
    """Partials with every kind of broken or empty entry the contract names.

    Row 0: one -inf partial whose out is NaN. Row 1: every partial -inf (all empty) and NaN
    outs. Row 2: a NaN lse. Row 3: a +inf lse. Row 4: lses far apart (weights underflow).
    Row 5: a NaN in the last column of a partial with weight > 0.
    """
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(num_parts, *rows, head_dim_v, generator=gen)
    lses = torch.randn(num_parts, *rows, generator=gen) * 4
    flat_outs, flat_lses = outs.view(num_parts, -1, head_dim_v), lses.view(num_parts, -1)
    flat_lses[0, 0], flat_outs[0, 0] = -math.inf, math.nan
    flat_lses[:, 1], flat_outs[:, 1] = -math.inf, math.nan
    if num_parts > 1:
        flat_lses[1, 2] = math.nan
        flat_lses[num_parts - 1, 3] = math.inf
        flat_lses[0, 4] = 200.0
        flat_outs[1, 5, -1] = math.nan
    return outs.to(dtype).to(DEVICE), lses.to(DEVICE)


def merge_as_defined(outs, lses):
    """The merge as the contract states it, in float64, written apart from every backend.

    Partials with lse -inf are skipped (their out may be NaN); a NaN or +inf lse, or a NaN
    out of a partial with weight > 0, makes the row NaN; an all-empty row is out 0, lse -inf.
    """
    outs, lses = outs.cpu().double(), lses.cpu().double()
    broken = (torch.isnan(lses) | (lses == math.inf)).any(dim=0)
    usable = torch.where(torch.isnan(lses) | (lses == math.inf), -math.inf, lses)
    top = usable.amax(dim=0)
    ref = torch.where(top == -math.inf, 0.0, top)
    weights = torch.exp(usable - ref)
    total = weights.sum(dim=0)
    acc = (torch.where(weights[..., None] > 0, outs, 0.0) * weights[..., None]).sum(dim=0)
    seen = total > 0
    out = torch.where(seen[..., None], acc / torch.where(seen, total, 1.0)[..., None], 0.0)
    lse = torch.where(seen, ref + torch.log(torch.where(seen, total, 1.0)), -math.inf)
    poisoned = broken | torch.isnan(acc).any(dim=-1)
    out[poisoned] = math.nan
    lse[poisoned] = math.nan
    return out, lse


def assert_same_merge(outs, lses, tol):
    """The kernel against ``merge_as_defined``; rows without NaN also against torch's merge."""
    out, lse = merge_states(outs, lses)
    out, lse = out.cpu(), lse.cpu()
    want_out, want_lse = merge_as_defined(outs, lses)
    assert out.dtype == outs.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol, equal_nan=True)
    clean = ~torch.isnan(want_lse)
    ref_out, ref_lse = torch_merge_states(outs.cpu(), lses.cpu())
    assert_same_attention(out[clean], lse[clean], ref_out[clean], ref_lse[clean], tol)
    return out, lse


@pytest.mark.parametrize(
    ("num_parts", "rows", "head_dim_v", "dtype"),
    [
        (2, (3, 4), 512, torch.float32),
        (7, (5, 2), 40, torch.float32),
        (32, (2, 3, 2), 512, torch.float32),  # more partials than one chunk of 16
        (1, (6,), 16, torch.float32),
        (3, (2, 4), 100, torch.float16),
    ],
)
def test_triton_merge_matches_torch(num_parts, rows, head_dim_v, dtype):
    outs, lses = random_partials(num_parts, rows, head_dim_v, dtype=dtype, seed=num_parts)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    out, lse = assert_same_merge(outs, lses, tol)
    flat_out, flat_lse = out.view(-1, head_dim_v), lse.view(-1)
    assert flat_lse[1] == -math.inf and (flat_out[1] == 0).all()  # the all-empty row
    if num_parts > 1:
        assert torch.isfinite(flat_lse[0]) and torch.isfinite(flat_out[0]).all()  # -inf, NaN out
        for row in (2, 3, 5):  # NaN lse, +inf lse, NaN out with weight > 0
            assert torch.isnan(flat_lse[row]) and torch.isnan(flat_out[row]).all()


def test_nan_out_in_the_second_dv_chunk_poisons_the_whole_row():
    """A NaN in column 300 of a weighted partial: on a GPU (256-wide Dv chunks) it is in the
    second chunk, after the first chunk's columns were stored; the whole row still ends NaN."""
    outs = torch.randn(3, 4, 512)
    lses = torch.randn(3, 4)
    outs[2, 1, 300] = math.nan
    lses[0, 2] = -math.inf
    outs[0, 2, 7] = math.nan  # weight 0: must not matter
    out, lse = merge_states(outs.to(DEVICE), lses.to(DEVICE))
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1])
    clean = torch.tensor([True, False, True, True])
    assert torch.isfinite(out[clean]).all() and torch.isfinite(lse[clean]).all()


@pytest.mark.parametrize(
    "target", [TritonTarget("hip", "gfx942", 304), TritonTarget("cuda", "sm90", 132)]
)
def test_gpu_tile_shapes(target):
    """The GPU block shapes (16 partials x 1 row x 512 dims per step), on any machine.

    Under the interpreter this runs the GPU tiling with the launch options ignored; on a
    GPU of the other vendor the options would not compile, so only the matching one runs.
    """
    here = triton_target()
    if here.backend != "interpreter" and here.backend != target.backend:
        pytest.skip(f"{target.backend} launch options on a {here.backend} GPU")
    outs, lses = random_partials(11, (6,), 512, seed=11)
    out = torch.empty(6, 512, device=DEVICE)
    lse = torch.empty(6, device=DEVICE)
    launch_merge(outs, lses, out, lse, target)
    want_out, want_lse = merge_as_defined(outs, lses)
    torch.testing.assert_close(out.cpu().double(), want_out, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_merge_of_split_attention_equals_whole_attention():
    """Splitting keys in two and merging gives attention over all keys."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 50, generator=gen)
    values = torch.randn(50, 32, generator=gen)
    halves = [slice(0, 20), slice(20, 50)]
    outs = torch.stack([torch.softmax(scores[:, s], -1) @ values[s] for s in halves])
    lses = torch.stack([torch.logsumexp(scores[:, s], -1) for s in halves])
    out, lse = merge_states(outs.to(DEVICE), lses.to(DEVICE))
    torch.testing.assert_close(out.cpu(), torch.softmax(scores, -1) @ values, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(scores, -1), atol=1e-6, rtol=1e-6)


#: Both implementations of the one merge contract: torch (the CPU path of
#: ``rocm_mla.merge_states``) and the Triton kernel (its GPU path), called directly so that
#: both run here whatever the device.
MERGES = {"torch": torch_merge_states, "triton": merge_states}


@pytest.mark.parametrize("impl", sorted(MERGES))
def test_zero_partials_give_empty_rows(impl):
    """N = 0 is the merge of no keys: mla_decode's empty row (out 0, lse -inf) on both."""
    out, lse = MERGES[impl](torch.zeros(0, 3, 8, device=DEVICE), torch.zeros(0, 3, device=DEVICE))
    assert out.shape == (3, 8) and lse.shape == (3,) and lse.dtype == torch.float32
    assert (out == 0).all() and (lse == -math.inf).all()


@pytest.mark.parametrize("impl", sorted(MERGES))
@pytest.mark.parametrize(
    ("outs", "lses", "match"),
    [
        (torch.zeros(2, 3, 8), torch.zeros(2, 4), r"lses \[N, \.\.\.rows\], got outs"),
        (torch.zeros(2, 3, 0), torch.zeros(2, 3), r"outs must have Dv >= 1"),
        (torch.ones(2, 3, 8, dtype=torch.int32), torch.zeros(2, 3), r"outs must be float32"),
        (torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.int64), r"lses must be float32"),
        (torch.zeros(2, 3, 8, dtype=torch.float64), torch.zeros(2, 3), r"outs must be float32"),
        ([torch.zeros(3, 8)] * 2, torch.zeros(2, 3), r"outs must be a torch.Tensor .*got list"),
        (torch.zeros(2, 3, 8), (torch.zeros(3),) * 2, r"lses must be a torch.Tensor .*got tuple"),
    ],
    ids=["shapes", "dv0", "int32-outs", "int-lses", "float64-outs", "list-outs", "tuple-lses"],
)
def test_bad_arguments_raise_the_same_named_error(impl, outs, lses, match):
    """Both paths refuse what they cannot merge, naming the argument, before any work."""
    if isinstance(outs, torch.Tensor):
        outs = outs.to(DEVICE)
    if isinstance(lses, torch.Tensor):
        lses = lses.to(DEVICE)
    with pytest.raises(ValueError, match=match):
        MERGES[impl](outs, lses)
    with pytest.raises(ValueError, match=match):
        rocm_mla.merge_states(outs, lses)


def test_torch_and_triton_agree_on_broken_and_empty_partials():
    """The NaN rule, both paths: a broken partial with weight poisons the whole row (every
    column and the lse), an empty partial never matters, an all-empty row is 0 / -inf."""
    outs, lses = random_partials(5, (3, 4), 48, seed=3)
    want_out, want_lse = torch_merge_states(outs, lses)
    got_out, got_lse = merge_states(outs, lses)
    torch.testing.assert_close(got_out, want_out, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-6, equal_nan=True)
    row5 = want_out.view(-1, 48)[5]  # one NaN column in a weighted partial
    assert torch.isnan(row5).all() and torch.isnan(want_lse.view(-1)[5])


def test_public_merge_states_uses_the_device_path():
    """rocm_mla.merge_states keeps torch on CPU and runs this kernel on a GPU; same answer.

    The partials have empty entries but no NaN/+inf lse: torch's merge is being moved to the
    NaN-propagating contract separately, and rows with broken partials are checked above.
    """
    outs, lses = random_partials(4, (3, 5), 64, seed=7)
    lses = torch.where(torch.isnan(lses) | (lses == math.inf), -math.inf, lses)
    outs.view(4, -1, 64)[1, 5, -1] = 0.0
    out, lse = rocm_mla.merge_states(outs, lses)
    ref_out, ref_lse = merge_states(outs, lses)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)


def test_grouped_partials_skip_the_rows_that_pad_a_group():
    """Stage 1's padded partials: 3 requests x 5 real rows in slots of 8; the padding rows
    hold NaN and +inf, which must never be read."""
    outs, lses = random_partials(4, (3, 5), 64, seed=5)
    ref_out, ref_lse = merge_states(outs.to(DEVICE), lses.to(DEVICE))
    padded_outs = torch.full((4, 3, 8, 64), math.nan, device=DEVICE)
    padded_lses = torch.full((4, 3, 8), math.inf, device=DEVICE)
    padded_outs[:, :, :5] = outs.to(DEVICE)
    padded_lses[:, :, :5] = lses.to(DEVICE)
    out = torch.empty(15, 64, device=DEVICE)
    lse = torch.empty(15, device=DEVICE)
    launch_merge(padded_outs[:, :, :5], padded_lses[:, :, :5], out, lse)
    torch.testing.assert_close(
        out.cpu(), ref_out.reshape(15, 64).cpu(), atol=1e-6, rtol=1e-6, equal_nan=True
    )
    torch.testing.assert_close(
        lse.cpu(), ref_lse.reshape(15).cpu(), atol=1e-6, rtol=1e-6, equal_nan=True
    )


@pytest.mark.parametrize(
    "target",
    [None, TritonTarget("hip", "gfx942", 304), TritonTarget("cuda", "sm90", 132)],
    ids=["here", "gfx942", "sm90"],
)
def test_merge_pieces_writes_the_real_rows_of_the_cut_units_only(target):
    """Stage 2 of the balanced schedule: 3 requests of 20 rows (S_q x H) in 16-row groups,
    so a request's second group holds 4 real rows and 12 that pad it. Unit 1 (request 0's
    second group) is cut into 3 segments, unit 4 (request 2's first) into 2; the tables
    have room for 4 cut units (-1 past the last). Each cut unit's real rows are the merge
    of its partials (broken and empty ones included); its pad rows' partials (NaN, +inf)
    are never written anywhere, and no other unit's rows are touched."""
    here = triton_target()
    if target is not None and here.backend not in ("interpreter", target.backend):
        pytest.skip(f"{target.backend} launch options on a {here.backend} GPU")
    batch, rows, group_rows, dv = 3, 20, 16, 64
    outs_a, lses_a = random_partials(3, (group_rows,), dv, seed=1)
    outs_b, lses_b = random_partials(2, (group_rows,), dv, seed=2)
    # Partials 0-2 (unit 1), 3-4 (unit 4), and a spare one no unit names.
    part_out = torch.cat([outs_a, outs_b, torch.zeros(1, group_rows, dv, device=DEVICE)])
    part_lse = torch.cat([lses_a, lses_b, torch.zeros(1, group_rows, device=DEVICE)])
    part_out[0:3, 4:] = math.nan  # unit 1's pad rows (request rows 20..31 do not exist)
    part_lse[0:3, 4:] = math.inf
    unit_parts = torch.tensor(
        [[-1, 1], [0, 3], [-1, 1], [-1, 1], [3, 2], [-1, 1]], dtype=torch.int32, device=DEVICE
    )
    split_units = torch.tensor([1, 4, -1, -1], dtype=torch.int32, device=DEVICE)
    out = torch.full((batch, rows, dv), 7.0, device=DEVICE)
    out_lse = torch.full((batch, rows), 7.0, device=DEVICE)
    launch_merge_pieces(
        part_out, part_lse, unit_parts, split_units, out, out_lse, num_groups=2, target=target
    )
    out, out_lse = out.cpu(), out_lse.cpu()
    want_out, want_lse = merge_as_defined(part_out[0:3, :4], part_lse[0:3, :4])
    torch.testing.assert_close(out[0, 16:].double(), want_out, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(
        out_lse[0, 16:].double(), want_lse, atol=1e-6, rtol=1e-6, equal_nan=True
    )
    want_out, want_lse = merge_as_defined(part_out[3:5], part_lse[3:5])
    torch.testing.assert_close(out[2, :16].double(), want_out, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(
        out_lse[2, :16].double(), want_lse, atol=1e-6, rtol=1e-6, equal_nan=True
    )
    # Rows 1..5 of a partial hold the broken/empty cases: the merge saw them.
    assert torch.isnan(out_lse[2, 2]) and out_lse[2, 1] == -math.inf
    untouched = torch.ones(batch, rows, dtype=torch.bool)
    untouched[0, 16:] = False
    untouched[2, :16] = False
    assert (out[untouched] == 7.0).all() and (out_lse[untouched] == 7.0).all()


def test_launch_merge_names_mismatched_shapes():
    outs, lses = torch.zeros(2, 3, 4, 64), torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"lses its shape without Dv, got \(2, 3, 4, 64\)"):
        launch_merge(outs, lses, torch.empty(12, 64), torch.empty(12))
    with pytest.raises(ValueError, match=r"out must be \[12, 64\]"):
        launch_merge(outs, lses[:, :, :4], torch.empty(10, 64), torch.empty(10))


@pytest.mark.parametrize(
    "target",
    [None, TritonTarget("hip", "gfx942", 304), TritonTarget("cuda", "sm90", 132)],
    ids=["here", "gfx942", "sm90"],
)
def test_merge_pieces_of_a_unit_cut_over_many_slots(target):
    """One unit cut into 300 partials (a request over every slot of a big GPU): more lses
    than one step of the first pass reads and many steps of the second. Partial 7 saw no
    key (lse -inf, its output NaN: never multiplied in, inside a step of weighted ones), row
    2's partial 250 has a NaN output (poisons the whole row), row 3's partial 299 a NaN lse
    (poisons it too); the other rows equal the merge as the contract states it."""
    here = triton_target()
    if target is not None and here.backend not in ("interpreter", target.backend):
        pytest.skip(f"{target.backend} launch options on a {here.backend} GPU")
    parts, group_rows, dv = 300, 4, 64
    gen = torch.Generator().manual_seed(300)
    part_out = torch.randn(parts, group_rows, dv, generator=gen)
    part_lse = torch.randn(parts, group_rows, generator=gen) * 3
    part_lse[7], part_out[7] = -math.inf, math.nan
    part_out[250, 2, 40] = math.nan
    part_lse[299, 3] = math.nan
    part_out, part_lse = part_out.to(DEVICE), part_lse.to(DEVICE)
    unit_parts = torch.tensor([[0, parts]], dtype=torch.int32, device=DEVICE)
    split_units = torch.tensor([0, -1], dtype=torch.int32, device=DEVICE)
    out = torch.full((1, group_rows, dv), 7.0, device=DEVICE)
    out_lse = torch.full((1, group_rows), 7.0, device=DEVICE)
    launch_merge_pieces(
        part_out, part_lse, unit_parts, split_units, out, out_lse, num_groups=1, target=target
    )
    want_out, want_lse = merge_as_defined(part_out, part_lse)
    torch.testing.assert_close(
        out[0].cpu().double(), want_out, atol=1e-6, rtol=1e-5, equal_nan=True
    )
    torch.testing.assert_close(
        out_lse[0].cpu().double(), want_lse, atol=1e-6, rtol=1e-6, equal_nan=True
    )
    assert torch.isnan(out[0, 2]).all() and torch.isnan(out[0, 3]).all()
    assert torch.isfinite(out[0, :2]).all() and torch.isfinite(out_lse[0, :2]).all()
