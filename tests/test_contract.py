"""The CP-normalization contract: its table, and that every impl enforces it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rocm_mla
from rocm_mla.backends import backend_class
from rocm_mla.contract import check_cp
from tests.reference import dense_mla_decode, make_paged_problem

NORMALIZED = [
    # disabled world sizes, with whatever rank came along
    ((-1, -1), (1, 0)),
    ((-1, None), (1, 0)),
    ((-1, 0), (1, 0)),
    ((-1, 3), (1, 0)),  # vLLM leaves the group rank next to the -1 sentinel
    ((None, None), (1, 0)),
    ((None, 0), (1, 0)),
    ((0, None), (1, 0)),
    ((0, 0), (1, 0)),
    # legal pairs pass through
    ((1, 0), (1, 0)),
    ((1, -1), (1, 0)),
    ((1, None), (1, 0)),
    ((2, 1), (2, 1)),
    ((8, 7), (8, 7)),
    ((np.int64(4), np.int32(2)), (4, 2)),
]

REJECTED = [
    ((2, 2), "outside [0, 2)"),
    ((4, 7), "outside [0, 4)"),
    ((4, -2), "outside [0, 4)"),
    ((2, None), "no rank was given"),
    ((4, -1), "no rank was given"),
    ((-2, 0), "below -1"),
    ((-5, None), "below -1"),
    ((-1, -3), "rank -3 is negative"),
    ((2.0, 0), "world_size must be an integer"),
    (("2", 0), "world_size must be an integer"),
    ((2, 1.0), "rank must be an integer"),
    ((True, 0), "got bool"),
]


@pytest.mark.parametrize(("pair", "expected"), NORMALIZED)
def test_normalize_cp_table(pair, expected):
    result = rocm_mla.normalize_cp(*pair)
    assert result == expected
    assert all(type(v) is int for v in result)
    check_cp(*result)


@pytest.mark.parametrize(("pair", "message"), REJECTED)
def test_normalize_cp_rejects(pair, message):
    with pytest.raises(ValueError, match="world_size") as info:
        rocm_mla.normalize_cp(*pair)
    assert message in str(info.value)
    # the message names both values
    assert repr(pair[0]) in str(info.value) and repr(pair[1]) in str(info.value)


@pytest.mark.parametrize("bad", [(-1, 0), (0, 0), (None, 0), (2, 2), (1, -1), (1.0, 0)])
def test_check_cp_rejects_unnormalized(bad):
    with pytest.raises(ValueError, match="normalize_cp"):
        check_cp(*bad)


@pytest.mark.parametrize("sentinel", [{}, {"dcp_world_size": -1}, {"dcp_world_size": None}])
def test_impl_built_directly_with_sentinel_decodes(sentinel):
    """The Kimi-K3 pattern: a layer builds the impl itself, with vLLM's -1 sentinel."""
    impl = backend_class("torch")(num_heads=16, head_dim_v=512, rope_dim=64, **sentinel)
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
    q, kv, bt, lens = make_paged_problem([5, 40], num_heads=16, seed=3)
    out, lse = impl.forward(q, kv, bt, lens)
    ref_out, ref_lse = dense_mla_decode(q, kv, bt, lens)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("world", "rank"), [(-1, 0), (None, 0), (0, 0), (2, 5), (3, 0.5)])
def test_assigning_illegal_pair_after_construction_raises(world, rank):
    impl = backend_class("torch")(num_heads=16)
    q, kv, bt, lens = make_paged_problem([7], num_heads=16)
    impl.dcp_world_size = world
    impl.dcp_rank = rank
    with pytest.raises(ValueError, match="illegal CP pair"):
        impl.forward(q, kv, bt, lens)


def test_impl_rejects_illegal_pair_at_construction():
    with pytest.raises(ValueError, match="outside"):
        backend_class("torch")(num_heads=16, dcp_world_size=2, dcp_rank=2)


def test_legal_cp_pair_is_kept():
    impl = backend_class("torch")(num_heads=16, dcp_world_size=4, dcp_rank=3)
    assert (impl.dcp_world_size, impl.dcp_rank) == (4, 3)
