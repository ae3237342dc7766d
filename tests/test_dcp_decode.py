"""DCP decode over token-sharded caches on 2 and 4 gloo ranks == single-process mla_decode.

Spawning ranks is slow, so each world size runs every one of its cases in one launch (a
module-scoped fixture); each case is still its own test item, compared here in the parent.
The shards are built from one global paged cache with the runner's ``slot_mapping``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import rocm_mla
from rocm_mla.backends import backend_class
from rocm_mla.backends.torch_ref import TorchMLAImpl
from rocm_mla.dcp import (
    RUNNER_CONTRACT,
    DecodeMetadata,
    dcp_mla_decode,
    plan_step_decode,
    slot_mapping,
)
from rocm_mla.distributed import ParallelState, WorkerError, launch
from rocm_mla.inputs import prepare_decode
from rocm_mla.merge import lse_merge_weights
from tests.reference import make_paged_problem

HEAD_DIM, HEAD_DIM_V = 576, 512
TOTAL_HEADS = 8
#: Long sequences mixed with ones shorter than N * I (empty shards) and an empty request.
LENGTHS = (150, 1, 37, 0, 5)
LAUNCH_TIMEOUT_S = 150.0


@dataclass(frozen=True)
class Case:
    world: int
    interleave: int
    q_len: int
    mode: str = "sharded"  # "sharded" heads (reduce-scatter) or "replicated" (all-reduce)
    backend: str = "torch"  # a backend name, or "sentinel-impl": an impl built with -1
    block_size: int = 16
    lengths: tuple[int, ...] = LENGTHS
    seed: int = 0
    planned: bool = False  # one plan_step_decode plan for the step, as the engine's runner

    @property
    def name(self) -> str:
        return (
            f"w{self.world}-I{self.interleave}-sq{self.q_len}-{self.mode}-{self.backend}"
            f"-bs{self.block_size}" + ("-planned" if self.planned else "")
        )


CASES = [
    Case(world, interleave, q_len, mode, seed=world * 100 + interleave + q_len)
    for world in (2, 4)
    for interleave in (1, 4, 16)
    for q_len in (1, 3)
    for mode in ("sharded", "replicated")
]
CASES += [
    Case(world, interleave, q_len, backend="triton", lengths=(40, 3, 0))
    for world in (2, 4)
    for interleave in (1, 16)
    for q_len in (1, 3)
]
CASES += [
    Case(world, 4, q_len, backend="sentinel-impl", block_size=32)
    for world in (2, 4)
    for q_len in (1, 3)
]
CASES += [
    Case(world, 4, q_len, backend=backend, planned=True, lengths=(40, 3, 0, 77))
    for world in (2, 4)
    for q_len in (1, 3)
    for backend in ("torch", "triton")
    if backend == "torch" or world == 2
]
#: Bad runner metadata: (name, what the layer gets instead of [B, S_q] local lengths).
BAD_METADATA = ("absent", "missing", "per-request-shape", "wrong-rank")


def skip_reason(case: Case) -> str | None:
    """Why ``case``'s backend cannot run its (CPU) problem here, e.g. Triton without a
    GPU or the interpreter; None when it can."""
    if case.backend != "triton":
        return None
    q, kv, block_table, seqlens = global_problem(case)
    problem = prepare_decode(
        q,
        kv,
        block_table,
        seqlens,
        head_dim_v=HEAD_DIM_V,
        softmax_scale=None,
        causal=True,
        kv_scale=None,
    )
    reasons = backend_class("triton").unsupported_reasons(problem)
    return f"triton backend cannot run here: {'; '.join(reasons)}" if reasons else None


def global_problem(case: Case):
    heads = TOTAL_HEADS
    return make_paged_problem(
        list(case.lengths),
        num_heads=heads,
        q_len=case.q_len,
        block_size=case.block_size,
        head_dim=HEAD_DIM,
        seed=case.seed,
    )


def shard(case: Case, kv, block_table, rank: int):
    """This rank's paged cache + local block table, written through ``slot_mapping``."""
    lengths, world, bs = case.lengths, case.world, case.block_size
    columns = max(1, -(-max(lengths) // (bs * world)))
    num_blocks = len(lengths) * columns + 2
    gen = torch.Generator().manual_seed(1000 + rank)
    table = torch.randperm(num_blocks, generator=gen)[: len(lengths) * columns]
    table = table.view(len(lengths), columns).to(torch.int32)
    local = torch.full((num_blocks, bs, HEAD_DIM), float("nan"))
    positions = torch.cat([torch.arange(n) for n in lengths])
    req = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)])
    rows = kv[block_table[req, positions // bs].long(), positions % bs]
    slots = slot_mapping(positions, req, table, bs, world, rank, case.interleave)
    owned = slots >= 0
    local.view(-1, HEAD_DIM)[slots[owned]] = rows[owned]
    return local, table


def run_case(state: ParallelState, case: Case):
    world, rank = state.layout.dcp, state.dcp_rank
    q, kv, block_table, seqlens = global_problem(case)
    local_kv, local_table = shard(case, kv, block_table, rank)
    meta = DecodeMetadata.build(
        local_table, seqlens, case.q_len, world, rank, dcp_interleave=case.interleave
    )
    backend = case.backend
    if backend == "sentinel-impl":
        backend = backend_class("torch")(
            num_heads=TOTAL_HEADS,
            head_dim_v=HEAD_DIM_V,
            rope_dim=HEAD_DIM - HEAD_DIM_V,
            dcp_world_size=-1,
            dcp_rank=rank,
        )
        assert (backend.dcp_world_size, backend.dcp_rank) == (1, 0)
    if case.mode == "replicated":
        q_in = q
    else:
        heads = TOTAL_HEADS // world
        q_in = q[:, :, rank * heads : (rank + 1) * heads]
    plan = None
    if case.planned:
        plan = plan_step_decode(
            seqlens,
            case.q_len,
            num_heads=TOTAL_HEADS,
            head_dim_v=HEAD_DIM_V,
            rope_dim=HEAD_DIM - HEAD_DIM_V,
            kv_dtype=local_kv.dtype,
            q_dtype=q.dtype,
            device="cpu",
            backend=case.backend,
            dcp_world_size=world,
            dcp_rank=rank,
            dcp_interleave=case.interleave,
        )
        # One window per request, every row with its own local bound (not a row per request);
        # a single query's bound is its request's length.
        assert (plan.batch, plan.spec.q_len) == (len(case.lengths), case.q_len)
        assert plan.spec.row_bounds == (world > 1 and case.q_len > 1) and plan.spec.causal
        # The same plan serves every MLA layer of the step: decode twice, as two layers.
        first = dcp_mla_decode(
            q_in, local_kv, meta, state.dcp_group, case.backend, head_dim_v=HEAD_DIM_V, plan=plan
        )
        assert first.shape == (*q_in.shape[:3], HEAD_DIM_V)
    return dcp_mla_decode(
        q_in,
        local_kv,
        meta,
        state.dcp_group,
        backend,
        return_lse=True,
        replicated_heads=case.mode == "replicated",
        head_dim_v=HEAD_DIM_V if case.backend != "sentinel-impl" else None,
        plan=plan,
    )


def bad_metadata_error(state: ParallelState, kind: str) -> str:
    case = Case(state.layout.dcp, 1, 2)
    world, rank = state.layout.dcp, state.dcp_rank
    q, kv, block_table, seqlens = global_problem(case)
    local_kv, local_table = shard(case, kv, block_table, rank)
    good = DecodeMetadata.build(local_table, seqlens, case.q_len, world, rank)
    bad = {
        "absent": None,  # the runner built no DecodeMetadata at all
        "missing": DecodeMetadata(local_table, seqlens, None, world, rank),
        "per-request-shape": DecodeMetadata(
            local_table, seqlens, good.dcp_local_seq_lens[:, -1], world, rank
        ),
        "wrong-rank": DecodeMetadata(
            local_table, seqlens, good.dcp_local_seq_lens, world, (rank + 1) % world
        ),
    }[kind]
    heads = TOTAL_HEADS // world
    try:
        dcp_mla_decode(q[:, :, :heads], local_kv, bad, state.dcp_group, "torch", head_dim_v=512)
    except ValueError as exc:
        return str(exc)
    return "no error"


def run_all(state: ParallelState, cases: list[Case]) -> dict:
    results = {case.name: run_case(state, case) for case in cases}
    results.update({kind: bad_metadata_error(state, kind) for kind in BAD_METADATA})
    return results


@pytest.fixture(scope="module")
def dcp_results():
    """world -> per-rank {case name: result}; one launch per world size, on first use."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cases = [c for c in CASES if c.world == world and skip_reason(c) is None]
            cache[world] = launch(
                run_all, world, args=(cases,), dcp=world, backend="gloo", timeout_s=LAUNCH_TIMEOUT_S
            )
        return cache[world]

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dcp_decode_matches_single_process(case, dcp_results):
    if skip_reason(case) is not None:
        pytest.skip(skip_reason(case))
    q, kv, block_table, seqlens = global_problem(case)
    backend = "torch" if case.backend == "sentinel-impl" else case.backend
    ref_out, ref_lse = rocm_mla.mla_decode(
        q, kv, block_table, seqlens, head_dim_v=HEAD_DIM_V, backend=backend
    )
    per_rank = [r[case.name] for r in dcp_results(case.world)]
    if case.mode == "replicated":
        pairs = per_rank
    else:
        pairs = [(torch.cat([o for o, _ in per_rank], 2), torch.cat([s for _, s in per_rank], 2))]
    for out, lse in pairs:
        assert not out.isnan().any()
        assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # The batch really has shards that are empty on some rank.
    assert min(case.lengths) < case.world * case.interleave


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", BAD_METADATA)
def test_bad_runner_metadata_raises_the_contract_error(world, kind, dcp_results):
    for message in (r[kind] for r in dcp_results(world)):
        if kind == "wrong-rank":
            assert "the runner and the layer must use the same DCP group" in message
        else:
            assert RUNNER_CONTRACT in message, message


def test_single_rank_needs_no_local_lengths():
    case = Case(1, 1, 3)
    q, kv, block_table, seqlens = global_problem(case)
    meta = DecodeMetadata(block_table, seqlens)
    out = dcp_mla_decode(q, kv, meta, None, "torch", head_dim_v=HEAD_DIM_V)
    ref, _ = rocm_mla.mla_decode(q, kv, block_table, seqlens, head_dim_v=HEAD_DIM_V)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class FailingImpl(TorchMLAImpl):
    def _decode(self, problem, plan):
        raise RuntimeError("injected fault in the decode kernel")


def decode_with_fault_on_rank_1(state: ParallelState) -> None:
    case = Case(state.layout.dcp, 1, 1)
    rank = state.dcp_rank
    q, kv, block_table, seqlens = global_problem(case)
    local_kv, local_table = shard(case, kv, block_table, rank)
    meta = DecodeMetadata.build(local_table, seqlens, 1, case.world, rank)
    impl_cls = FailingImpl if rank == 1 else TorchMLAImpl
    impl = impl_cls(num_heads=TOTAL_HEADS, head_dim_v=HEAD_DIM_V, rope_dim=HEAD_DIM - HEAD_DIM_V)
    heads = TOTAL_HEADS // case.world
    # Rank 0 gathers q with rank 1, then waits for rank 1's lse, which never comes.
    dcp_mla_decode(
        q[:, :, rank * heads : (rank + 1) * heads], local_kv, meta, state.dcp_group, impl
    )


def spawned_children() -> list[int]:
    """Live or zombie worker processes (spawned interpreters) whose parent is this process."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_rank_that_raises_mid_decode_fails_the_launch_fast():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(decode_with_fault_on_rank_1, 2, dcp=2, backend="gloo", timeout_s=LAUNCH_TIMEOUT_S)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert "rank 1 of 2 failed" in str(info.value)
    assert "injected fault in the decode kernel" in str(info.value)
    assert spawned_children() == []


def test_combine_weights_are_exact_empty_shards_get_zero_and_broken_ones_nan():
    inf, nan = float("inf"), float("nan")
    lses = torch.tensor([[0.5, -inf, -inf, nan], [2.0, 1.0, -inf, 3.0], [-1.0, -inf, -inf, inf]])
    weights, total = lse_merge_weights(lses)
    expected_total = torch.logsumexp(torch.tensor([[0.5, 2.0, -1.0], [1.0, -inf, -inf]]), dim=1)
    torch.testing.assert_close(total[:2], expected_total)
    torch.testing.assert_close(weights[:, 0], torch.exp(lses[:, 0] - total[0]))
    assert weights[:, 1].tolist() == [0.0, 1.0, 0.0]
    assert weights[:, 2].tolist() == [0.0, 0.0, 0.0] and total[2] == -inf
    # NaN and +inf lses are broken partials: the row comes out NaN, never a silent drop.
    assert torch.isnan(weights[:, 3]).all() and torch.isnan(total[3])


def test_a_single_rank_plan_without_the_lse_decodes_but_cannot_return_one():
    """The runner plans a single-rank step without the LSE (issue 43); a DCP decode with such
    a plan still works on one rank, and asking it for the LSE is refused before any work."""
    q, kv, bt, lens = make_paged_problem([9, 30], num_heads=16, block_size=16, seed=7)
    plan = plan_step_decode(
        lens, 1, num_heads=16, head_dim_v=512, rope_dim=64, kv_dtype=kv.dtype,
        q_dtype=q.dtype, device="cpu", backend="torch",
    )  # fmt: skip
    assert not plan.spec.lse
    meta = DecodeMetadata(bt, lens)
    out = dcp_mla_decode(q, kv, meta, None, backend="torch", plan=plan)
    ref, _ = rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="plan the step with return_lse=True"):
        dcp_mla_decode(q, kv, meta, None, backend="torch", plan=plan, return_lse=True)
