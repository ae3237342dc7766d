"""Launch planning: the stage-1 config of a decode shape and the resident slots its balanced
schedule fills (``plan_launch``), and the per-piece overhead that schedule's cost model
charges. ``choose_num_kv_splits`` is the uniform split count of earlier releases (every
request of a step cut into the same number of splits), kept as the reference ``rocm-mla
bench schedule`` measures the balanced schedule against.
"""

from __future__ import annotations

import torch

from rocm_mla.kernels.mla_decode_args import _group_config, default_config
from rocm_mla.kernels.occupancy import programs_per_cu
from rocm_mla.kernels.target import TritonTarget, triton_target
from rocm_mla.kernels.tuned_configs import LaunchConfig

__all__ = ["choose_num_kv_splits", "plan_launch"]


#: What one more program or segment costs, in keys of work: its prologue (q rows, the block
#: table scan), the fp32 partial it writes and stage 2 reading it back. 84 is the constant of
#: AITER's split heuristic (its ``num_kv_splits`` scoring), whose shape the uniform planner
#: took; the balanced schedule (``schedule.OVERHEAD_KEYS``), ``rocm-mla bench schedule`` and
#: ``choose_num_kv_splits`` all charge it. Unmeasured here: a GPU run must time a one-tile
#: segment against a many-tile one (``scripts/gpu_check.sh``) to confirm it.
SPLIT_OVERHEAD_TOKENS = 84.0
#: Below this many keys per split the overhead dominates; never split finer. 128, not 256:
#: a DCP rank's 4K-16K share of a 32K context at B 8 then still fills 0.9 of a wave
#: (the cost model above already charges each split its overhead).
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
    efficiency = ``mean_len / (mean_len + SPLIT_OVERHEAD_TOKENS * s)``. Candidates run from 1
    to ``MAX_SPLITS`` while the longest request keeps ``MIN_TOKENS_PER_SPLIT`` keys per split;
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
        score = fill * mean_len / (mean_len + SPLIT_OVERHEAD_TOKENS * splits)
        if score > best_score:
            best, best_score = splits, score
    return best


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
    balanced schedule (``schedule.py``) packs the step's keys into that many slots.
    """
    target = triton_target() if target is None else target
    if target is None:
        raise RuntimeError("plan_launch: no Triton target on this machine")
    if config is None:
        config = default_config(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype)
    config = _group_config(config, q_len * num_heads)
    slots = target.num_cus * programs_per_cu(
        config,
        target,
        kv_dtype=kv_dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_heads=num_heads,
        q_len=q_len,
        q_dtype=q_dtype,
        page_size=64 if page_size is None else page_size,
        cache_bytes=cache_bytes,
    )
    return config, slots
