"""The context-parallel (CP) normalization contract: the one place it is written.

Upstream vLLM MLA impls were built with ``dcp_world_size = -1`` ("resolved later by the
attention wrapper"). A layer that constructs the impl itself (Kimi-K3's MLA) never passes
through that wrapper, so the sentinel reached the kernels. Every impl in this package runs
its arguments through :func:`normalize_cp` at construction and :func:`check_cp` at every
call, whoever built it.
"""

from __future__ import annotations

import operator

#: World sizes that mean "context parallelism disabled / not resolved".
DISABLED_WORLD_SIZES = (None, -1, 0)
#: Ranks that mean "no rank given".
DISABLED_RANKS = (None, -1)

_RULE = (
    "expected a disabled world size (None, -1 or 0) or an integer world size >= 1 "
    "with an integer rank in [0, world_size)"
)


def _as_int(value: object, name: str, world_size: object, rank: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(
            f"CP {name} must be an integer, got bool {value!r} "
            f"(world_size={world_size!r}, rank={rank!r}); {_RULE}"
        )
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"CP {name} must be an integer, got {type(value).__name__} {value!r} "
            f"(world_size={world_size!r}, rank={rank!r}); {_RULE}"
        ) from None


def normalize_cp(world_size: object, rank: object) -> tuple[int, int]:
    """Resolve a (world_size, rank) pair to a legal one, or raise ``ValueError``.

    * ``world_size`` None, -1 or 0 means CP is disabled (or was never resolved): the result
      is ``(1, 0)`` whatever rank came with it (vLLM leaves the group rank in place next to
      the -1 sentinel; a CP-unaware kernel must see rank 0 and the layer owns the combine).
    * ``world_size >= 1`` with ``rank`` in ``[0, world_size)`` passes through; with
      ``world_size == 1`` a disabled rank (None or -1) becomes 0.
    * Anything else (rank outside the world, world < -1, non-integers) raises.
    """
    world = _as_int(world_size, "world_size", world_size, rank)
    r = _as_int(rank, "rank", world_size, rank)
    if world in DISABLED_WORLD_SIZES:
        if r is not None and r < -1:
            raise ValueError(
                f"illegal CP pair (world_size={world_size!r}, rank={rank!r}): "
                f"rank {r} is negative; {_RULE}"
            )
        return 1, 0
    if world < 1:
        raise ValueError(
            f"illegal CP pair (world_size={world_size!r}, rank={rank!r}): "
            f"world_size {world} is below -1; {_RULE}"
        )
    if r in DISABLED_RANKS:
        if world == 1:
            return 1, 0
        raise ValueError(
            f"illegal CP pair (world_size={world_size!r}, rank={rank!r}): "
            f"CP is enabled with {world} ranks but no rank was given; {_RULE}"
        )
    if not 0 <= r < world:
        raise ValueError(
            f"illegal CP pair (world_size={world_size!r}, rank={rank!r}): "
            f"rank {r} is outside [0, {world}); {_RULE}"
        )
    return world, r


def check_cp(world_size: object, rank: object) -> None:
    """Raise ``ValueError`` unless the pair is already normalized (what kernels may see).

    Cheap enough for every kernel call; catches a caller that assigned the sentinel back
    onto an impl after construction.
    """
    if type(world_size) is int and type(rank) is int and world_size >= 1 and 0 <= rank < world_size:
        return
    raise ValueError(
        f"illegal CP pair (dcp_world_size={world_size!r}, dcp_rank={rank!r}) reached an MLA "
        "decode kernel; kernels need an integer world size >= 1 and a rank in [0, world_size). "
        "The impl normalized its pair at construction, so something assigned this later: "
        "pass the pair through rocm_mla.normalize_cp() before assigning it"
    )
