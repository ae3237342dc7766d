"""Specialization-proof kernels (issue 36, item 2): every launch the decode makes compiles for
sm90, gfx942 and gfx950 with every integer argument that can be 1 at 1.

On a GPU, Triton's binder turns an integer argument equal to 1 into a constexpr (a Python
int inside the kernel), which the interpreter never does: a method call on it
(``max_blocks.to(tl.int64)``) then fails to compile, e.g. whenever every request fits in one
page. Here the host code runs on ``meta`` tensors with the kernels swapped for recorders
(``benchmarks.kernel_static``: ``_recording``, ``specialize``), over shapes that put every
such argument at 1 in some launch of its kernel: one request, a one-column block table, a
one-block cache, S_q 1, one head, page size 1, one slot and one pool, size-1 dimensions with
stride 1, a merge of one partial of one row of width 1. Each distinct specialization is
compiled once per target through Triton's binder and compiler, in a child process without the
interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.compile_helpers import run_compiler

#: The targets compiled for: all three, or ``ROCM_MLA_COMPILE_TARGETS`` (``make compile-check``
#: under Triton 3.4, which builds gfx942 only).
TARGETS = tuple(os.environ.get("ROCM_MLA_COMPILE_TARGETS", "sm90,gfx942,gfx950").split(","))
HEAD_DIM, HEAD_DIM_V = 576, 512


@dataclasses.dataclass(frozen=True)
class Shape:
    """One ``mla_decode`` call: one request, a one-column block table, a one-block cache."""

    name: str
    heads: int
    q_len: int
    kv: str  #: "bf16" or "fp8"
    page_size: int
    causal: bool = True
    #: The config's ``num_xcds`` forced to 1 (one schedule pool; AMD's tables plan 8).
    one_pool: bool = False
    fault_flag: bool = False


#: Every stage-1 code path the tables pick, each with the integer arguments at 1 where the
#: shape allows: page 1 (a table capacity of one key; ids read per key) and page 64 (one
#: id per tile), the verify window's tail tiles, the non-causal (DCP) walk, fp8 with q
#: quantized, the 64-row groups (sm90's wgmma, AMD's rows owned per wave) and one group.
SHAPES = (
    Shape("H1 Sq1 bf16 page 1", 1, 1, "bf16", 1, one_pool=True, fault_flag=True),
    Shape("H1 Sq1 fp8 page 1", 1, 1, "fp8", 1),
    Shape("H1 Sq2 bf16 page 1 window", 1, 2, "bf16", 1),
    Shape("H1 Sq1 fp8 page 64 non-causal", 1, 1, "fp8", 64, causal=False),
    Shape("H64 Sq1 bf16 page 64", 64, 1, "bf16", 64),
    Shape("H64 Sq1 fp8 page 64", 64, 1, "fp8", 64),
    Shape("H16 Sq4 bf16 page 64 window", 16, 4, "bf16", 64),
)

#: Integer arguments no launch can pass as 1, and why: the test checks that every other
#: one is 1 in some launch of its kernel, and that these never are.
NEVER_ONE = {
    "_mla_decode_stage1": {
        # The output and partial buffers are allocated by mla_decode: rows of Dv (512) or
        # BLOCK_H (>= 16) values.
        "stride_out_b": "out is [B, S_q, H, Dv], allocated contiguous",
        "stride_out_h": "out is [B, S_q, H, Dv], allocated contiguous",
        "stride_part_p": "partials are [P, BLOCK_H, Dv], allocated contiguous",
        "stride_part_r": "partials are [P, BLOCK_H, Dv], allocated contiguous",
        "stride_part_lse_p": "partial lses are [P, BLOCK_H], allocated contiguous",
    },
    "_plan_schedule_kernel": {
        "launch_programs": "pools x (units + slots per pool): at least 2",
    },
    "_merge_pieces_kernel": {
        "stride_po_p": "partials are [P, BLOCK_H, Dv], allocated contiguous",
        "stride_po_r": "partials are [P, BLOCK_H, Dv], allocated contiguous",
        "stride_pl_p": "partial lses are [P, BLOCK_H], allocated contiguous",
        "stride_out_r": "out is [B, S_q, H, Dv], allocated contiguous",
        "stride_out_b": "out is [B, S_q, H, Dv], allocated contiguous",
        "row_blocks": "BLOCK_H (>= 16) rows a unit, one per program on a GPU (_merge_blocks)",
    },
    "_merge_states_kernel": {},
    "_quantize_q_kernel": {},
    "_launch_order_kernel": {},
}


def _unit_strided(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous meta tensor whose size-1 dimensions have stride 1, as views may have
    them (their stride is never used to step, so any value is valid)."""
    t = torch.empty(*shape, dtype=dtype, device="meta")
    strides = [1 if n == 1 else s for n, s in zip(shape, t.stride(), strict=True)]
    return t.as_strided(shape, strides)


def _int_arguments(launch) -> dict[str, int]:
    """The non-constexpr integer arguments of a recorded launch, by parameter name."""
    from benchmarks import kernel_static as ks

    fn = ks._jit_function(launch)
    values = dict(zip([p.name for p in fn.params], launch.args, strict=False)) | launch.kwargs
    return {
        p.name: values[p.name]
        for p in fn.params
        if not p.is_constexpr
        and isinstance(values.get(p.name), int)
        and not isinstance(values[p.name], bool)
    }


def record_shape(shape: Shape, target_key: str) -> list:
    """The launches of one ``mla_decode`` call of ``shape`` on ``target_key``."""
    from benchmarks import kernel_static as ks
    from rocm_mla.kernels import mla_decode as md

    target = ks.TARGETS[target_key]
    tt = target.triton_target()
    kv_dtype = torch.bfloat16 if shape.kv == "bf16" else target.fp8_dtype
    q = _unit_strided(1, shape.q_len, shape.heads, HEAD_DIM, dtype=torch.bfloat16)
    kv_cache = _unit_strided(1, shape.page_size, HEAD_DIM, dtype=kv_dtype)
    # The planner's config, as the decode launches it (where a Triton cannot build the
    # table's config, the planner's fallback).
    config, _ = md.plan_launch(
        q_len=shape.q_len,
        num_heads=shape.heads,
        kv_dtype=kv_dtype,
        target=tt,
        q_dtype=torch.bfloat16,
        head_dim=HEAD_DIM,
        head_dim_v=HEAD_DIM_V,
        page_size=shape.page_size,
        cache_bytes=kv_cache.untyped_storage().nbytes(),
    )
    if shape.one_pool:
        config = dataclasses.replace(config, num_xcds=1)
    block_table = _unit_strided(1, 1, dtype=torch.int32)
    seqlens = _unit_strided(1, dtype=torch.int32)
    flag = torch.empty(1, dtype=torch.int32, device="meta") if shape.fault_flag else None
    with ks._recording(tt) as launches:
        md.mla_decode(
            q,
            kv_cache,
            block_table,
            seqlens,
            head_dim_v=HEAD_DIM_V,
            softmax_scale=HEAD_DIM**-0.5,
            causal=shape.causal,
            kv_scale=None if shape.kv == "bf16" else 1.0,
            config=config,
            num_slots=1,
            fault_flag=flag,
        )
    return launches


def record_merge(target_key: str, head_dim_v: int) -> list:
    """The launch of ``rocm_mla.merge_states`` (the DCP combine) over one partial of one
    row; at ``head_dim_v`` 1 every stride it passes is 1 too."""
    from benchmarks import kernel_static as ks
    from rocm_mla.kernels.merge_states import merge_states

    target = ks.TARGETS[target_key]
    outs = torch.empty(1, 1, head_dim_v, dtype=torch.float32, device="meta")
    lses = torch.empty(1, 1, dtype=torch.float32, device="meta")
    with ks._recording(target.triton_target()) as launches:
        merge_states(outs, lses)
    return launches


def record_target(target_key: str) -> tuple[list[dict], dict[str, dict], list[str]]:
    """``(a summary of each launch, the compile requests by key, the shapes that could not be
    planned and why)`` on ``target_key``: what the decode launches for every shape."""
    from benchmarks import kernel_static as ks

    recorded, planning = [], []
    for shape in SHAPES:
        # Planning compiles stage 1 (its residency): it may fail under an old Triton.
        with ks.compiler_stderr() as diagnostics:
            try:
                recorded.append((shape.name, record_shape(shape, target_key)))
                failure = None
            except Exception as error:  # reported by the test, with the shape and target
                failure = error
        if failure is not None:
            text = ks.describe_failure(failure, diagnostics)
            planning.append(f"{shape.name} on {target_key}: planning fails: {text}")
    for dv in (HEAD_DIM_V, 1):
        recorded.append((f"merge_states, one partial, Dv {dv}", record_merge(target_key, dv)))
    launches, requests = [], {}
    for name, shape_launches in recorded:
        for launch in shape_launches:
            request = ks.specialize(launch, ks.TARGETS[target_key])
            requests.setdefault(request["key"], request)
            ints = _int_arguments(launch)
            names = [p.name for p in ks._jit_function(launch).params]
            launches.append(
                {
                    "shape": name,
                    "target": target_key,
                    "kernel": launch.kernel,
                    "key": request["key"],
                    "ints": sorted(ints),
                    "ones": sorted(k for k, v in ints.items() if v == 1),
                    "constexpr_ones": sorted(
                        names[path[0]]
                        for path, value in request["constexprs"].items()
                        if names[path[0]] in ints and value == 1
                    ),
                }
            )
    return launches, requests, planning


def sweep(targets: tuple[str, ...] = TARGETS, workers: int = 2) -> dict:
    """Record every shape's launches on every target (a process per target), compile each
    distinct specialization once, and report per launch: its kernel, the integer arguments
    at 1, and the error."""
    from benchmarks import kernel_static as ks

    ks.use_hip_linker()
    pool = ks.spawn_pool(workers)
    if pool is None:
        recorded = [record_target(t) for t in targets]
    else:
        recorded = [f.result() for f in [pool.submit(record_target, t) for t in targets]]
    launches = [x for target_launches, _, _ in recorded for x in target_launches]
    requests = {k: r for _, target_requests, _ in recorded for k, r in target_requests.items()}
    outcomes = {o["key"]: o for o in ks.pooled(ks.try_build, list(requests.values()), pool)}
    if pool is not None:
        pool.shutdown()
    planning = [line for _, _, target_planning in recorded for line in target_planning]
    return {"launches": launches, "outcomes": outcomes, "planning": planning}


@pytest.fixture(scope="module")
def swept() -> dict:
    code = "import json; from tests.test_specialization import sweep; print(json.dumps(sweep()))"
    return json.loads(run_compiler(code, timeout=1800).strip().splitlines()[-1])


@pytest.mark.slow
def test_every_launch_compiles_with_its_int_arguments_at_one(swept: dict) -> None:
    failed = list(swept["planning"])
    for key, outcome in sorted(swept["outcomes"].items()):
        if outcome["error"] is not None:
            launch = next(x for x in swept["launches"] if x["key"] == key)
            failed.append(
                f"{launch['kernel']} on {launch['target']} ({launch['shape']}; at 1: "
                f"{', '.join(launch['constexpr_ones'])}):\n{outcome['error']}"
            )
    assert not failed, f"{len(failed)} failures ({len(swept['outcomes'])} builds):\n\n" + (
        "\n\n".join(failed)
    )


@pytest.mark.slow
def test_the_shapes_put_every_int_argument_at_one(swept: dict) -> None:
    """Each kernel on each target saw each of its integer arguments at 1 in some launch (and
    Triton's binder made it a constexpr there), except the ones ``NEVER_ONE`` names."""
    by_kernel: dict[tuple[str, str], list[dict]] = {}
    for launch in swept["launches"]:
        by_kernel.setdefault((launch["kernel"], launch["target"]), []).append(launch)
    assert {k for k, _ in by_kernel} == set(NEVER_ONE), "a kernel is not launched, or new"
    assert {t for _, t in by_kernel} == set(TARGETS)
    for (kernel, target), launches in sorted(by_kernel.items()):
        ints = set().union(*(x["ints"] for x in launches))
        at_one = set().union(*(x["constexpr_ones"] for x in launches))
        assert all(set(x["ones"]) == set(x["constexpr_ones"]) for x in launches), (
            f"{kernel} on {target}: an int argument at 1 was not specialized to a constexpr"
        )
        missing = ints - at_one - set(NEVER_ONE[kernel])
        assert not missing, f"{kernel} on {target}: no launch has {sorted(missing)} at 1"
        wrong = at_one & set(NEVER_ONE[kernel])
        assert not wrong, f"{kernel} on {target}: NEVER_ONE lists {sorted(wrong)}, at 1 here"
