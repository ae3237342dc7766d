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
from rocm_mla.inputs import DecodeProblem, prepare_decode


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data (``None`` = no restriction)."""

    platforms: tuple[str, ...]  #: platform kinds: "cpu", "cuda", "hip"
    q_dtypes: tuple[torch.dtype, ...]
    kv_dtypes: tuple[torch.dtype, ...]
    block_sizes: tuple[int, ...] | None = None
    num_heads: tuple[int, ...] | None = None
    max_q_len: int | None = None


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
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"{self.name}: num_heads must be an int >= 1, got {num_heads!r}")
        if not isinstance(head_dim_v, int) or head_dim_v < 1:
            raise ValueError(f"{self.name}: head_dim_v must be an int >= 1, got {head_dim_v!r}")
        if not isinstance(rope_dim, int) or rope_dim < 0:
            raise ValueError(f"{self.name}: rope_dim must be an int >= 0, got {rope_dim!r}")
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
    def unsupported_reasons(cls, problem: DecodeProblem) -> list[str]:
        """Every reason this backend cannot run ``problem`` (empty when it can)."""
        reason = cls.unavailable_reason()
        if reason is not None:
            return [reason]
        caps = cls.capabilities
        reasons = []
        kind = device_kind(problem.q.device)
        if kind not in caps.platforms:
            reasons.append(f"tensors on {kind}, supported: {', '.join(caps.platforms)}")
        if problem.q.dtype not in caps.q_dtypes:
            reasons.append(f"q dtype {problem.q.dtype}, supported: {_names(caps.q_dtypes)}")
        if problem.kv_cache.dtype not in caps.kv_dtypes:
            reasons.append(
                f"kv_cache dtype {problem.kv_cache.dtype}, supported: {_names(caps.kv_dtypes)}"
            )
        if caps.block_sizes is not None and problem.block_size not in caps.block_sizes:
            reasons.append(f"block size {problem.block_size}, supported: {caps.block_sizes}")
        if caps.num_heads is not None and problem.num_heads not in caps.num_heads:
            reasons.append(f"{problem.num_heads} heads, supported: {caps.num_heads}")
        if caps.max_q_len is not None and problem.q_len > caps.max_q_len:
            reasons.append(f"q_len {problem.q_len}, supported: up to {caps.max_q_len}")
        return reasons

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode; shapes and semantics as ``rocm_mla.mla_decode``. Returns ``(out, lse)``."""
        problem = prepare_decode(
            q,
            kv_cache,
            block_table,
            cache_seqlens,
            head_dim_v=self.head_dim_v,
            softmax_scale=self.softmax_scale,
            causal=causal,
            kv_scale=kv_scale,
        )
        if (
            problem.num_heads != self.num_heads
            or problem.head_dim != self.head_dim_v + self.rope_dim
        ):
            raise ValueError(
                f"{self.name}: q must be [B, S_q, {self.num_heads}, "
                f"{self.head_dim_v + self.rope_dim}] for this impl (num_heads={self.num_heads}, "
                f"head_dim_v={self.head_dim_v}, rope_dim={self.rope_dim}), "
                f"got {tuple(q.shape)}"
            )
        reasons = self.unsupported_reasons(problem)
        if reasons:
            raise ValueError(
                f"MLA backend '{self.name}' cannot run this call: {'; '.join(reasons)}"
            )
        return self.run(problem)

    def run(self, problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode an already validated problem; re-checks the CP pair first, every call."""
        check_cp(self.dcp_world_size, self.dcp_rank)
        return self._decode(problem)

    def _decode(self, problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel itself. Subclasses implement this."""
        raise NotImplementedError
