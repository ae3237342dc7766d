"""Launch planning: the stage-1 config of a decode shape and the resident slots its balanced
schedule fills (``plan_launch``; a config the installed Triton cannot compile gives way to one
it can). ``choose_num_kv_splits`` is the uniform split count of earlier releases (every
request of a step cut into the same number of splits, chosen with the schedule's cost model,
``schedule.cost``), kept as the reference ``rocm-mla bench schedule`` measures the balanced
schedule against.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, replace

import torch

from rocm_mla.kernels.mla_decode_args import default_config, group_config
from rocm_mla.kernels.occupancy import Stage1CompileError, programs_per_cu
from rocm_mla.kernels.schedule.cost import MERGE_KEYS, OVERHEAD_KEYS
from rocm_mla.kernels.target import (
    TritonTarget,
    say_once,
    triton_target,
    unsupported_triton_reason,
)
from rocm_mla.kernels.tuned_configs import LaunchConfig

__all__ = ["choose_num_kv_splits", "plan_launch"]


#: Below this many keys per split the overhead dominates; never split finer. 128, not 256:
#: a DCP rank's 4K-16K share of a 32K context at B 8 then still fills 0.9 of a wave
#: (the schedule's cost model, ``schedule.cost``, already charges each split its overhead).
MIN_TOKENS_PER_SPLIT = 128
#: Upper bound on splits (stage 2 reads them all back per output row). Room for one 32K
#: request of 16 heads to fill two programs on each of MI300X's 304 CUs in 0.9 of a wave
#: (B8 x 32K needs 76 splits there); MIN_TOKENS_PER_SPLIT still bounds short requests.
MAX_SPLITS = 128


def choose_num_kv_splits(
    batch: int, num_groups: int, mean_len: float, max_len: int, num_cus: int
) -> int:
    """Splits per request that best trade compute-unit fill against per-split overhead.

    Score of ``s`` splits = fill x efficiency, where fill = programs / (programs rounded up
    to whole waves of ``num_cus`` slots) with programs = ``batch * num_groups * s``, and
    efficiency = ``mean_len / (mean_len + c * s)``, ``c`` = the schedule's cost model's
    ``OVERHEAD_KEYS`` plus, for ``s`` > 1, its ``MERGE_KEYS`` (each split's prologue and its
    partial's share of the merge; ``schedule.cost``). Candidates run from 1 to
    ``MAX_SPLITS`` while the longest request keeps ``MIN_TOKENS_PER_SPLIT`` keys per split;
    ties go to fewer splits. ``num_cus`` is the number of programs that run at once: compute
    units x ``programs_per_cu`` in ``plan_launch``.
    """
    if mean_len <= 0 or max_len <= 0:
        return 1
    best, best_score = 1, -1.0
    for splits in range(1, MAX_SPLITS + 1):
        if splits > 1 and -(-max_len // splits) < MIN_TOKENS_PER_SPLIT:
            break
        programs = batch * num_groups * splits
        fill = programs / (-(-programs // num_cus) * num_cus)
        per_split = OVERHEAD_KEYS + (MERGE_KEYS if splits > 1 else 0)
        score = fill * mean_len / (mean_len + per_split * splits)
        if score > best_score:
            best, best_score = splits, score
    return best


def _config_text(config: LaunchConfig, than: LaunchConfig | None = None) -> str:
    """``config``'s fields as ``name=value``: those that differ from ``than``, or without it
    the block shapes and every field off its default."""

    def shown(f) -> bool:
        value = getattr(config, f.name)
        if than is not None:
            return value != getattr(than, f.name)
        return f.default is MISSING or value != f.default

    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in fields(config) if shown(f))


def _fallbacks(config: LaunchConfig) -> list[tuple[str, LaunchConfig]]:
    """What ``plan_launch`` tries, in order, when ``config`` does not compile: each step gives
    up one more thing, with what it gave up.

    Chosen from what compiles: on sm90 under Triton 3.5.1 and 3.6.0 the software pipeliner
    fails (an MLIR pass failure) on every fp8 group and every 64-row 16-bit group of
    ``bench static``'s cases, and one stage compiles all of them. The later steps (the block
    ids loaded in the tile's own trip, half the keys per tile, 16-bit dots for an fp8
    cache) also compile there; they are for a config or a Triton that fails otherwise.
    """
    steps = []
    current = config

    def give_up(what: str, **changes) -> None:
        nonlocal current
        candidate = replace(current, **changes)
        if candidate != current:
            steps.append((what, candidate))
            current = candidate

    give_up("no software pipelining", num_stages=1, shrunk_num_stages=None)
    give_up("block ids loaded in the tile's own trip", prefetch_ids=False, shrunk_prefetch_ids=None)
    give_up("half the keys per tile", block_n=max(16, current.block_n // 2))
    give_up("16-bit dots", fp8_qk=False, fp8_pv=False, keys_as_m=False, shrunk_keys_as_m=None)
    return steps


def plan_launch(
    *,
    q_len: int,
    num_heads: int,
    kv_dtype: torch.dtype,
    target: TritonTarget | None = None,
    config: LaunchConfig | None = None,
    q_dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 576,
    head_dim_v: int = 512,
    page_size: int | None = None,
    cache_bytes: int = 0,
) -> tuple[LaunchConfig, int]:
    """The stage-1 launch config of a decode shape and the resident slots its schedule fills.

    Pure host arithmetic (no tensor is read; the first call per shape compiles stage 1 for
    ``programs_per_cu``): ``rocm_mla.plan_decode`` calls it once per step and every layer of
    the step launches with the answer. The config comes from the tuned table of ``target``
    (``default_config``) unless given; the slots are ``num_cus x programs_per_cu`` (the
    compiled kernel's occupancy for this shape; ``page_size`` None assumes 64,
    ``cache_bytes`` is the KV cache's size: HIP uses buffer loads only below 2 GiB). The
    balanced schedule (``schedule``) packs the step's keys into that many slots.

    The returned config is the one to launch: when the installed Triton cannot compile the
    planned one for ``target`` (that compile is the residency's), it is the first of
    ``_fallbacks`` that compiles, and stderr says so once (the Triton version, the config,
    what changed). Raises ``RuntimeError`` naming the Triton version when it is below the
    target's floor (``target.SUPPORTED_TRITON``) or when no fallback compiles either.
    """
    target = triton_target() if target is None else target
    if target is None:
        raise RuntimeError("plan_launch: no Triton target on this machine")
    reason = unsupported_triton_reason(target)
    if reason is not None:
        raise RuntimeError(f"plan_launch: {reason}")
    if config is None:
        config = default_config(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype)
    config = group_config(config, q_len * num_heads)
    shape = dict(
        kv_dtype=kv_dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_heads=num_heads,
        q_len=q_len,
        q_dtype=q_dtype,
        page_size=64 if page_size is None else page_size,
        cache_bytes=cache_bytes,
    )
    try:
        return config, target.num_cus * programs_per_cu(config, target, **shape)
    except Stage1CompileError as exc:
        failure = exc
    for gave_up, candidate in _fallbacks(config):
        try:
            per_cu = programs_per_cu(candidate, target, **shape)
        except Stage1CompileError:
            continue
        say_once(
            ("fallback", str(target), config, candidate),
            f"rocm_mla: {failure}; the planned config was {_config_text(config)}. The plan "
            f"launches it with {_config_text(candidate, config)} instead ({gave_up}), "
            "possibly slower.",
        )
        return candidate, target.num_cus * per_cu
    raise RuntimeError(
        f"plan_launch: {failure}; the planned config was {_config_text(config)}, and none of "
        f"its fallbacks ({', '.join(what for what, _ in _fallbacks(config))}) compiles "
        "either. Use another backend, or a Triton release the decode supports "
        "(rocm_mla.kernels.target.SUPPORTED_TRITON)."
    )
