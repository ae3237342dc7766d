"""The one impl base class every MLA decode backend inherits.

A backend is a static description (name, capabilities, reasons it cannot run) plus an impl
that computes. The base class owns the CP-normalization contract: ``__init__`` resolves the
``dcp_world_size``/``dcp_rank`` it is handed (the -1 sentinel included) and every
``forward`` re-checks the pair, so no construction path can hand a kernel illegal
context-parallel metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rocm_mla.contract import check_cp, normalize_cp
from rocm_mla.inputs import (
    DEBUG_ENV_VAR,
    DecodePlan,
    DecodeProblem,
    DecodeSpec,
    KVBoundsError,
    check_decode_values,
    debug_checks_enabled,
    prepare_decode,
)
from rocm_mla.platform import same_device


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data. Limits that are not plain sets (AITER's head counts
    and verify-window lengths per cache type, known kernel bugs) are the backend's own
    ``unsupported_reasons``."""

    platforms: tuple[str, ...]  #: platform kinds: "cpu", "cuda", "hip"
    q_dtypes: tuple[torch.dtype, ...]
    kv_dtypes: tuple[torch.dtype, ...]
    #: windows of different lengths in one call (q packed with ``query_start_loc``)
    varlen: bool = False
    #: a KV bound per query row (``row_seqlens``: DCP verify windows)
    row_bounds: bool = False


def device_kind(device: torch.device) -> str:
    """The platform kind a tensor lives on: "cpu", "cuda" or "hip"."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return device.type


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


class MLADecodeImpl:
    """Absorbed-MLA decode over a paged latent cache, FlashMLA-shaped.

    Args:
        num_heads: query heads the kernel sees (under DCP: the gathered count).
        head_dim_v: latent width, the V part of each cache row (kv_lora_rank, 512).
        rope_dim: rope width appended to each row (64).
        softmax_scale: defaults to ``(head_dim_v + rope_dim) ** -0.5``.
        dcp_world_size, dcp_rank: anything ``normalize_cp`` accepts, the -1 sentinel and
            ``None`` included; stored normalized.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(
        self,
        num_heads: int,
        head_dim_v: int = 512,
        rope_dim: int = 64,
        softmax_scale: float | None = None,
        dcp_world_size: int | None = -1,
        dcp_rank: int | None = -1,
    ) -> None:
        self.dcp_world_size, self.dcp_rank = normalize_cp(dcp_world_size, dcp_rank)
        for name, value, low in (
            ("num_heads", num_heads, 1),
            ("head_dim_v", head_dim_v, 1),
            ("rope_dim", rope_dim, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{self.name}: {name} must be an int >= {low}, got {value!r}")
        self.num_heads = num_heads
        self.head_dim_v = head_dim_v
        self.rope_dim = rope_dim
        self.softmax_scale = softmax_scale

    # ---- static description -------------------------------------------------------------

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine at all (None when it can)."""
        return None

    @classmethod
    def target(cls) -> str | None:
        """What this backend would run on here, for ``rocm-mla info`` (e.g. "hip gfx942")."""
        return None

    @classmethod
    def auto_skip_reason(cls) -> str | None:
        """Why ``auto`` should not pick this backend even though it can run (None: it may)."""
        return None

    @classmethod
    def unsupported_reasons(cls, call: DecodeSpec | DecodeProblem) -> list[str]:
        """Every reason this backend cannot run ``call`` (empty when it can).

        ``call`` is a ``DecodeSpec`` (shapes and dtypes, from ``plan_decode``) or a whole
        ``DecodeProblem``.
        """
        spec = call.spec if isinstance(call, DecodeProblem) else call
        reason = cls.unavailable_reason()
        if reason is not None:
            return [reason]
        caps = cls.capabilities
        reasons = []
        kind = device_kind(spec.device)
        if kind not in caps.platforms:
            reasons.append(f"tensors on {kind}, supported: {', '.join(caps.platforms)}")
        if spec.q_dtype not in caps.q_dtypes:
            reasons.append(f"q dtype {spec.q_dtype}, supported: {_names(caps.q_dtypes)}")
        if spec.kv_dtype not in caps.kv_dtypes:
            reasons.append(f"kv_cache dtype {spec.kv_dtype}, supported: {_names(caps.kv_dtypes)}")
        if spec.varlen and not caps.varlen:
            reasons.append("windows of different lengths in one call (query_start_loc)")
        if spec.row_bounds and not caps.row_bounds:
            reasons.append("a KV bound per query row (row_seqlens)")
        return reasons

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
    ) -> object:
        """The backend's per-step launch decisions (``DecodePlan.launch``); None when the
        backend needs none. ``lengths`` (``[B]``, on the CPU or the plan's device, or None)
        are the step's own lengths for a backend that schedules by them without reading a
        device tensor back; ``capacity_keys`` the block table's capacity and
        ``cache_bytes`` the KV cache's size, when known."""
        return None

    @classmethod
    def reschedule(cls, plan: DecodePlan, cache_seqlens: torch.Tensor) -> None:
        """Re-plan ``plan``'s device data for this step's lengths in place (``replan_decode``);
        nothing for a backend whose plan holds only host decisions."""

    @classmethod
    def make_plan(
        cls,
        spec: DecodeSpec,
        *,
        batch: int,
        min_seqlen: int,
        max_seqlen: int,
        total_seqlen: int,
        bounds_only: bool = False,
        lengths: torch.Tensor | None = None,
        capacity_keys: int | None = None,
        cache_bytes: int | None = None,
    ) -> DecodePlan:
        """A ``DecodePlan`` for this backend (the length range already known on the host;
        ``lengths``, ``capacity_keys`` and ``cache_bytes`` as ``plan_launch``)."""
        return DecodePlan(
            backend=cls.name,
            spec=spec,
            batch=batch,
            min_seqlen=min_seqlen,
            max_seqlen=max_seqlen,
            total_seqlen=total_seqlen,
            bounds_only=bounds_only,
            launch=cls.plan_launch(
                spec,
                batch=batch,
                max_seqlen=max_seqlen,
                total_seqlen=total_seqlen,
                lengths=lengths,
                bounds_only=bounds_only,
                capacity_keys=capacity_keys,
                cache_bytes=cache_bytes,
            ),
        )

    @classmethod
    def plan_problem(cls, problem: DecodeProblem) -> DecodePlan:
        """Plan a one-shot call from its own lengths, with no host read of its own: their
        range is the one the value checks read (``prepare_decode``); a problem they did not
        run on gets them here (one host read)."""
        lengths = problem.seqlen_range
        if lengths is None:
            lengths = check_decode_values(problem)
        low, high, total = lengths
        kv = problem.kv_cache
        return cls.make_plan(
            problem.spec,
            batch=problem.batch,
            min_seqlen=low,
            max_seqlen=high,
            total_seqlen=total,
            lengths=problem.cache_seqlens,
            capacity_keys=problem.block_table.shape[1] * kv.shape[1],
            cache_bytes=kv.numel() * kv.element_size(),
        )

    # ---- compute ------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        *,
        causal: bool = True,
        kv_scale: float | torch.Tensor | None = None,
        plan: DecodePlan | None = None,
        fault_flag: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        max_q_len: int | None = None,
        row_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode; shapes and semantics as ``rocm_mla.mla_decode`` (``plan=``,
        ``fault_flag=``, packed windows and per-row bounds included).

        The one place the sequence check -> select -> plan -> run is written: ``mla_decode``
        and the vLLM impl both come through here.
        """
        problem = prepare_decode(
            q,
            kv_cache,
            block_table,
            cache_seqlens,
            head_dim_v=self.head_dim_v,
            softmax_scale=self.softmax_scale,
            causal=causal,
            kv_scale=kv_scale,
            check_values=plan is None,
            fault_flag=fault_flag,
            query_start_loc=query_start_loc,
            max_q_len=max_q_len,
            row_seqlens=row_seqlens,
        )
        if (
            problem.num_heads != self.num_heads
            or problem.head_dim != self.head_dim_v + self.rope_dim
        ):
            rows = "T" if problem.varlen else "B, S_q"
            raise ValueError(
                f"{self.name}: q must be [{rows}, {self.num_heads}, "
                f"{self.head_dim_v + self.rope_dim}] for this impl (num_heads={self.num_heads}, "
                f"head_dim_v={self.head_dim_v}, rope_dim={self.rope_dim}), "
                f"got {tuple(q.shape)}"
            )
        if plan is None:
            reasons = self.unsupported_reasons(problem)
            if reasons:
                raise ValueError(
                    f"MLA backend '{self.name}' cannot run this call: {'; '.join(reasons)}"
                )
        return self.run(problem, plan)

    def run(
        self, problem: DecodeProblem, plan: DecodePlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode an already validated problem; re-checks the CP pair first, every call.

        With ``plan`` the call must match it (shapes, dtypes, device, backend); nothing is
        read back from the device. Without, the problem is planned here (one host sync).
        The LSE is None when the plan was made without one (``plan.spec.lse`` False).
        """
        check_cp(self.dcp_world_size, self.dcp_rank)
        if plan is None:
            plan = self.plan_problem(problem)
        else:
            check_plan_matches(plan, problem, self.name)
            if debug_checks_enabled():
                check_lengths_within_plan(plan, problem)
        out, lse = self._decode(problem, plan)
        return out, (lse if plan.spec.lse else None)

    def _decode(
        self, problem: DecodeProblem, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel itself. Subclasses implement this; it must read no tensor. The LSE may
        be None only for a plan without one (``plan.spec.lse`` False)."""
        raise NotImplementedError


def check_plan_matches(plan: DecodePlan, problem: DecodeProblem, backend: str) -> None:
    """Raise unless ``problem`` is a call ``plan`` was made for (host metadata only)."""
    if not isinstance(plan, DecodePlan):
        raise ValueError(
            f"mla_decode: plan must be a DecodePlan from rocm_mla.plan_decode, got "
            f"{type(plan).__name__}"
        )
    spec = plan.spec
    got = problem.spec
    mismatches = [
        f"{what}: plan {want}, call {have}"
        for what, want, have in (
            ("backend", plan.backend, backend),
            ("batch", plan.batch, problem.batch),
            ("varlen (query_start_loc)", spec.varlen, got.varlen),
            ("row bounds (row_seqlens)", spec.row_bounds, got.row_bounds),
            ("num_heads", spec.num_heads, got.num_heads),
            ("head_dim", spec.head_dim, got.head_dim),
            ("head_dim_v", spec.head_dim_v, got.head_dim_v),
            ("q dtype", spec.q_dtype, got.q_dtype),
            ("kv_cache dtype", spec.kv_dtype, got.kv_dtype),
            ("causal", spec.causal, got.causal),
        )
        if want != have
    ]
    # Packed windows are planned for the longest a step may bring (a graph's maximum draft);
    # uniform ones for exactly theirs.
    if got.q_len > spec.q_len or (not spec.varlen and got.q_len != spec.q_len):
        longest = "up to " if spec.varlen else ""
        mismatches.append(f"q_len: plan {longest}{spec.q_len}, call {got.q_len}")
    if not same_device(spec.device, got.device):
        mismatches.append(f"device: plan {spec.device}, call {got.device}")
    if spec.block_size is not None and spec.block_size != got.block_size:
        mismatches.append(f"block_size: plan {spec.block_size}, call {got.block_size}")
    if mismatches:
        raise ValueError(
            "mla_decode: the call does not match its plan (make one plan per step with "
            f"rocm_mla.plan_decode for these shapes): {'; '.join(mismatches)}"
        )


def check_lengths_within_plan(plan: DecodePlan, problem: DecodeProblem) -> None:
    """``ROCM_MLA_DEBUG``: the call's lengths lie in the plan's ``[min_seqlen, max_seqlen]``
    (``[0, graph_max_seqlen]`` for a graph plan) and sum to at most its ``total_seqlen``,
    else ``KVBoundsError``.

    Without the debug switch nothing is read: lengths the plan does not cover are then a
    fault the backend handles on the device (NaN rows, ``FAULT_*`` bits), never a read
    outside the cache.
    """
    lens = problem.cache_seqlens
    lo, hi = (int(v) for v in torch.aminmax(lens))
    total = int(lens.to(torch.int64).clamp(min=0).sum())
    kind = "graph plan's bound" if plan.bounds_only else "plan's range"
    if lo < plan.min_seqlen or hi > plan.max_seqlen:
        raise KVBoundsError(
            f"mla_decode ({DEBUG_ENV_VAR}): cache_seqlens span [{lo}, {hi}], outside the "
            f"{kind} [{plan.min_seqlen}, {plan.max_seqlen}] ({plan.backend} plan); plan "
            "each step from its own lengths"
        )
    if total > plan.total_seqlen:
        # AITER sizes its per-token metadata by the plan's total.
        raise KVBoundsError(
            f"mla_decode ({DEBUG_ENV_VAR}): cache_seqlens sum to {total}, more than the "
            f"{plan.total_seqlen} tokens the {plan.backend} plan was made for; plan each "
            "step from its own lengths"
        )
