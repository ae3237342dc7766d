"""Runner-side DCP functions against a brute-force, per-token model of ownership."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocm_mla.dcp import (
    DecodeMetadata,
    local_seq_lens,
    owner_rank,
    slot_mapping,
    verify_local_seq_lens,
)

WORLD_SIZES = (1, 2, 3, 4, 8)
INTERLEAVES = (1, 2, 4, 16, 64)


def brute_force_shards(length: int, world: int, interleave: int) -> list[list[int]]:
    """Per rank, the global positions it owns in order: deal out runs of I tokens."""
    shards: list[list[int]] = [[] for _ in range(world)]
    rank, run = 0, 0
    for p in range(length):
        shards[rank].append(p)
        run += 1
        if run == interleave:
            rank, run = (rank + 1) % world, 0
    return shards


@pytest.mark.parametrize(
    ("length", "world", "interleave", "expected"),
    [(65, 4, 1, [17, 16, 16, 16]), (10, 4, 2, [4, 2, 2, 2]), (3, 4, 2, [2, 1, 0, 0])],
)
def test_local_seq_lens_examples(length, world, interleave, expected):
    lens = torch.tensor([length], dtype=torch.int32)
    assert local_seq_lens(lens, world, None, interleave).tolist() == [expected]
    for r in range(world):
        assert local_seq_lens(lens, world, r, interleave).tolist() == [expected[r]]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=4),
    world=st.sampled_from(WORLD_SIZES),
    interleave=st.sampled_from(INTERLEAVES),
)
def test_local_seq_lens_matches_ownership(lengths, world, interleave):
    lens = torch.tensor(lengths, dtype=torch.int32)
    all_ranks = local_seq_lens(lens, world, None, interleave)
    assert all_ranks.shape == (len(lengths), world) and all_ranks.dtype == torch.int32
    assert all_ranks.sum(dim=1).tolist() == lengths
    for b, length in enumerate(lengths):
        shards = brute_force_shards(length, world, interleave)
        assert all_ranks[b].tolist() == [len(s) for s in shards]
        positions = torch.arange(length)
        owners = owner_rank(positions, world, interleave).tolist()
        assert all(owners[p] == r for r, shard in enumerate(shards) for p in shard)
    for r in range(world):
        assert torch.equal(local_seq_lens(lens, world, r, interleave), all_ranks[:, r])


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 400), min_size=1, max_size=3),
    world=st.sampled_from(WORLD_SIZES),
    interleave=st.sampled_from(INTERLEAVES),
    blocks_per_interleave=st.sampled_from((1, 2, 4)),
    seed=st.integers(0, 2**16),
)
def test_slot_mapping_is_a_dense_prefix_of_the_local_cache(
    lengths, world, interleave, blocks_per_interleave, seed
):
    block_size = interleave * blocks_per_interleave
    virtual = block_size * world
    columns = max(1, -(-max(lengths) // virtual))
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(lengths) * columns
    # Every rank gets its own random physical block assignment, as separate caches would.
    tables = [
        torch.randperm(num_blocks, generator=gen).view(len(lengths), columns).to(torch.int32)
        for _ in range(world)
    ]
    positions = torch.cat([torch.arange(n) for n in lengths])
    req_indices = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)])
    slots = torch.stack(
        [
            slot_mapping(positions, req_indices, tables[r], block_size, world, r, interleave)
            for r in range(world)
        ]
    )  # [N, T]
    assert ((slots >= 0).sum(dim=0) == 1).all(), "every position is owned exactly once"

    start = 0
    for b, length in enumerate(lengths):
        shards = brute_force_shards(length, world, interleave)
        for r in range(world):
            s = slots[r, start : start + length]
            owned = (s >= 0).nonzero().flatten().tolist()
            assert owned == shards[r]
            # Invert the paged layout: a slot's local position is (column, offset).
            column_of_block = {int(blk): j for j, blk in enumerate(tables[r][b])}
            local = [
                column_of_block[int(x) // block_size] * block_size + int(x) % block_size
                for x in s[owned]
            ]
            assert local == list(range(len(shards[r]))), "local tokens form a dense prefix"
        start += length


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    q_len=st.integers(1, 5),
    world=st.sampled_from(WORLD_SIZES),
    interleave=st.sampled_from(INTERLEAVES),
)
def test_verify_local_seq_lens_counts_what_each_row_sees(lengths, q_len, world, interleave):
    lens = torch.tensor(lengths, dtype=torch.int32)
    rows = verify_local_seq_lens(lens, q_len, world, None, interleave)
    assert rows.shape == (len(lengths), q_len, world)
    for b, length in enumerate(lengths):
        for i in range(q_len):
            visible = max(0, length - (q_len - 1) + i)
            owners = [(p // interleave) % world for p in range(visible)]
            assert rows[b, i].tolist() == [owners.count(r) for r in range(world)]
    for r in range(world):
        assert torch.equal(verify_local_seq_lens(lens, q_len, world, r, interleave), rows[..., r])


def test_verify_rows_are_not_local_length_minus_offset():
    # L=10, N=2, I=1, window 3: row 0 sees 8 tokens (4 + 4); local(10) - 2 would say 3 on rank 0.
    rows = verify_local_seq_lens(torch.tensor([10]), 3, 2, 0, 1)
    assert rows.tolist() == [[4, 5, 5]]


def test_decode_metadata_build_fills_local_lengths_only_under_dcp():
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([9, 2], dtype=torch.int32)
    meta = DecodeMetadata.build(table, lens, 2, dcp_world_size=2, dcp_rank=1, dcp_interleave=2)
    assert meta.dcp_local_seq_lens.tolist() == [[4, 4], [0, 0]]
    assert DecodeMetadata.build(table, lens, 2).dcp_local_seq_lens is None


def test_slot_mapping_rejects_block_size_not_multiple_of_interleave():
    table = torch.zeros(1, 4, dtype=torch.int32)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="must be a multiple of dcp_interleave=4"):
        slot_mapping(pos, torch.zeros(8, dtype=torch.int64), table, 6, 2, 0, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0, "rank": 0}, "world_size must be an int >= 1"),
        ({"world_size": 2, "rank": 2}, r"rank must be None or an int in \[0, 2\)"),
        ({"world_size": 2, "rank": 0, "interleave": 0}, "interleave must be an int >= 1"),
    ],
)
def test_local_seq_lens_rejects_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        local_seq_lens(torch.tensor([5]), **kwargs)


def test_runner_functions_reject_float_lengths_and_positions_past_the_table():
    with pytest.raises(ValueError, match="seq_lens must be an integer tensor"):
        local_seq_lens(torch.tensor([5.0]), 2, 0)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="positions must lie in"):
        slot_mapping(torch.tensor([64]), torch.tensor([0]), table, 16, 2, 0)
