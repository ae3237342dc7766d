"""Triton MLA decode backend: HIP (MI300X first), CUDA, and the CPU interpreter.

One kernel source (``rocm_mla.kernels.mla_decode_kernel``, launched by
``rocm_mla.kernels.mla_decode``) serves every target. On a machine with no GPU it runs under
``TRITON_INTERPRET=1``: correct but slow, so it is for tests only and ``auto`` never picks it.
Nothing here imports triton or queries a GPU driver until a backend question is actually asked.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, replace

import torch

from rocm_mla.backends.base import Capabilities, MLADecodeImpl
from rocm_mla.inputs import Q_DTYPES, DecodePlan, DecodeProblem, DecodeSpec

_NOT_INSTALLED = (
    "triton is not installed (CPU/CUDA: pip install 'rocm-mla[triton]'; ROCm images ship "
    "their own Triton, never install the PyPI wheel over it)"
)
_BASE_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _target():
    """The Triton target (``TritonTarget``), or None; never raises on a CPU-only machine."""
    if importlib.util.find_spec("triton") is None:
        return None
    from rocm_mla.kernels.target import triton_target

    return triton_target()


@functools.cache
def _capabilities() -> Capabilities:
    target = _target()
    if target is None:
        return Capabilities(platforms=(), q_dtypes=Q_DTYPES, kv_dtypes=_BASE_KV_DTYPES)
    # The fp8 flavours its hardware computes (registry: ``TargetSpec.fp8_dtypes``).
    fp8 = target.spec.fp8_dtypes
    platforms = ("cpu",) if target.backend == "interpreter" else (target.backend,)
    # Every target takes packed windows and per-row bounds: one kernel source.
    ragged = {"varlen": True, "row_bounds": True}
    return Capabilities(
        platforms=platforms, q_dtypes=Q_DTYPES, kv_dtypes=(*_BASE_KV_DTYPES, *fp8), **ragged
    )


class _LazyCapabilities:
    """Resolves ``TritonMLAImpl.capabilities`` on first access, not at import.

    Which platforms and fp8 flavours the backend supports depends on the Triton target, and
    finding it out queries the GPU driver; doing that when the registry merely imports this
    module would initialize the GPU in processes that may still fork workers.
    """

    def __get__(self, instance, owner) -> Capabilities:
        return _capabilities()


@dataclass
class TritonLaunch:
    """A Triton plan's launch data (``DecodePlan.launch``): the stage-1 config, the resident
    slots it balances over, and the step's schedule tables on the plan's device
    (``rocm_mla.kernels.schedule``; rewritten in place by ``reschedule``)."""

    config: object  #: kernels.tuned_configs.LaunchConfig
    num_slots: int
    schedule: object  #: kernels.schedule.ScheduleTables
    capacity_keys: int  #: the block-table capacity the schedule clamps lengths to

    @property
    def balanced(self) -> str:
        """One phrase for logs: how the step is scheduled (no tensor is read)."""
        used = self.schedule.used_slots
        if used is None:
            return f"balanced over {self.num_slots} slots"
        return f"balanced: {used} of {self.num_slots} slots filled"


def _schedule(
    spec: DecodeSpec,
    config,
    num_slots: int,
    batch: int,
    lengths: torch.Tensor | None,
    bounds_only: bool,
    capacity_keys: int,
):
    """The schedule tables of a plan: built on the host from host lengths (with the exact
    grid and partial count), on the device from device lengths (no host read)."""
    from rocm_mla.kernels import schedule as sch

    if lengths is None:
        raise ValueError("triton: a plan needs the step's lengths (plan_decode passes them)")
    num_groups = -(-(spec.q_len * spec.num_heads) // config.block_h)
    if lengths.device.type == "cpu":
        tables = sch.host_schedule(
            [int(v) for v in lengths.tolist()],
            num_groups=num_groups,
            num_slots=num_slots,
            capacity_keys=capacity_keys,
            num_pools=config.num_xcds,
            device=spec.device,
        )
        # A graph plan launches for any later lengths: with the capacities, not these counts.
        if bounds_only:
            return replace(tables, used_slots=None, num_partials=None, num_programs=None)
        return tables
    tables = sch.empty_tables(batch, num_groups, num_slots, spec.device, config.num_xcds)
    sch.device_schedule(lengths.to(torch.int32), tables, capacity_keys=capacity_keys)
    return tables


@functools.lru_cache(maxsize=64)
def _launch_shape(spec: DecodeSpec, cache_bytes: int) -> tuple[object, int]:
    """``kernels.plan.plan_launch`` for a call's shapes: the stage-1 config and the resident
    slots. Host arithmetic over what a process never changes (the target, the tuned table,
    the compiled residency), so kept per (spec, cache size): a one-shot call of a shape
    already seen does no launch planning."""
    from rocm_mla.kernels.plan import plan_launch

    return plan_launch(
        q_len=spec.q_len,
        num_heads=spec.num_heads,
        kv_dtype=spec.kv_dtype,
        q_dtype=spec.q_dtype,
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v,
        page_size=spec.block_size,
        cache_bytes=cache_bytes,
    )


#: Forces the slots every Triton plan balances over (as ``TritonMLAImpl(num_slots=)``): the
#: interpreter has one, so engine tests under it set more to exercise the cut and the merge.
SLOTS_ENV = "ROCM_MLA_TRITON_SLOTS"


def _forced_slots() -> int | None:
    text = os.environ.get(SLOTS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{SLOTS_ENV} must be an int >= 1 when set, got {text!r}")
    return int(text)


class TritonMLAImpl(MLADecodeImpl):
    """Balanced split-KV Triton MLA decode (``rocm_mla.kernels.schedule``).

    Args (beyond ``MLADecodeImpl``'s):
        num_slots: force the number of resident slots the schedule balances over (>= 1);
            None takes the target's (compute units x the compiled kernel's programs per
            CU). The interpreter has one: tests force more to exercise the merge.
    """

    name = "triton"
    capabilities = _LazyCapabilities()

    def __init__(self, *args, num_slots: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if num_slots is not None and (
            isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1
        ):
            raise ValueError(f"triton: num_slots must be an int >= 1 or None, got {num_slots!r}")
        self.num_slots = num_slots

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return _NOT_INSTALLED
        target = _target()
        if target is None:
            from rocm_mla.kernels.target import triton_target_unavailable_reason

            return triton_target_unavailable_reason()
        from rocm_mla.kernels.target import unsupported_triton_reason

        return unsupported_triton_reason(target)

    @classmethod
    def target(cls) -> str | None:
        target = _target()
        return None if target is None else str(target)

    @classmethod
    def unsupported_reasons(cls, call: DecodeSpec | DecodeProblem) -> list[str]:
        reasons = super().unsupported_reasons(call)
        if cls.unavailable_reason() is not None:
            return reasons
        from rocm_mla.kernels.mla_decode_args import refusal_reason

        spec = call.spec if isinstance(call, DecodeProblem) else call
        # A shape the tuned table refuses on this target (its entry's ``refuse``).
        refused = refusal_reason(
            _target(), num_heads=spec.num_heads, q_len=spec.q_len, kv_dtype=spec.kv_dtype
        )
        return reasons if refused is None else [*reasons, refused]

    @classmethod
    def auto_skip_reason(cls) -> str | None:
        target = _target()
        if target is not None and target.backend == "interpreter":
            return "the Triton interpreter is for testing only (slow); ask for it by name"
        return None

    @classmethod
    def plan_launch(
        cls,
        spec: DecodeSpec,
        *,
        batch: int,
        max_seqlen: int,
        total_seqlen: int,
        lengths: torch.Tensor | None = None,
        bounds_only: bool = False,
        capacity_keys: int | None = None,
        cache_bytes: int | None = None,
    ) -> TritonLaunch:
        """Stage-1 block shapes, slots (``kernels.plan.plan_launch``, cached per shape) and
        the step's balanced schedule from ``lengths`` (module ``kernels.schedule``). Without
        ``cache_bytes`` the lengths' bytes stand in for the cache's size."""
        from rocm_mla.kernels.schedule import MAX_KEYS

        if cache_bytes is None:
            cache_bytes = total_seqlen * spec.head_dim * spec.kv_dtype.itemsize
        config, num_slots = _launch_shape(spec, cache_bytes)
        num_slots = _forced_slots() or num_slots
        capacity = MAX_KEYS if capacity_keys is None else min(capacity_keys, MAX_KEYS)
        schedule = _schedule(spec, config, num_slots, batch, lengths, bounds_only, capacity)
        return TritonLaunch(config, num_slots, schedule, capacity)

    @classmethod
    def reschedule(cls, plan: DecodePlan, cache_seqlens: torch.Tensor) -> None:
        """Rewrite ``plan``'s schedule in place on the device from this step's lengths (no
        host read; the tables keep their addresses, so a captured graph replays them)."""
        from rocm_mla.kernels.schedule import device_schedule

        launch = plan.launch
        device_schedule(
            cache_seqlens.to(torch.int32), launch.schedule, capacity_keys=launch.capacity_keys
        )
        # The host's grid and partial counts no longer hold.
        launch.schedule = replace(
            launch.schedule, used_slots=None, num_partials=None, num_programs=None
        )

    def _decode(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from rocm_mla.kernels import mla_decode

        launch = plan.launch
        forced = self.num_slots is not None and self.num_slots != launch.num_slots
        return mla_decode.mla_decode(
            problem.q,
            problem.kv_cache,
            problem.block_table,
            problem.cache_seqlens,
            head_dim_v=problem.head_dim_v,
            softmax_scale=problem.softmax_scale,
            causal=problem.causal,
            kv_scale=problem.kv_scale,
            config=launch.config,
            schedule=None if forced else launch.schedule,
            num_slots=self.num_slots,
            fault_flag=problem.fault_flag,
            query_start_loc=problem.query_start_loc,
            max_q_len=plan.spec.q_len,
            row_seqlens=problem.row_seqlens,
        )
