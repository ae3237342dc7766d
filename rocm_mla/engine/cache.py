"""Cache bookkeeping: paged latent-KV blocks and KDA state slots, handed out from free lists.

The tensors themselves are per pipeline stage (``KimiK3ForCausalLM.make_caches`` builds only
that stage's layers' caches); this module decides which block ids and state rows a request
uses. Every rank runs the same allocator on the same requests in the same order, so the ids
agree across ranks without being sent.

Under decode context parallelism (DCP size ``N``) a block-table column is a *virtual* block of
``block_size * N`` tokens: each rank keeps its ``block_size`` of them in its own physical
block with the same id (``rocm_mla.dcp.slot_mapping``). A length-``L`` request therefore needs
``cdiv(L, block_size * N)`` blocks on every rank.
"""

from __future__ import annotations

import torch

from rocm_mla.inputs import FP8_DTYPES


class CacheFullError(RuntimeError):
    """The cache cannot hold what was asked of it; the message says by how much and the fix.

    ``detail`` is what did not fit, ``knob`` the ``LLM`` argument that raises the limit and
    ``minimum`` the value it needs (the CLI names its own flag from them).
    """

    def __init__(self, detail: str, knob: str, minimum: int) -> None:
        super().__init__(f"{detail}; raise LLM({knob}=...) to at least {minimum}")
        self.detail, self.knob, self.minimum = detail, knob, minimum

    def __reduce__(self):
        return (type(self), (self.detail, self.knob, self.minimum))


class FreeList:
    """Integer ids ``[0, capacity)`` handed out lowest-first and returned on free.

    Memory is proportional to the ids in use, never to ``capacity``: ids at or above the
    high-water mark have never been handed out, and only returned ids are kept in a stack.

    Args:
        capacity: how many ids exist.
        what: what an id is, for error messages ("KV cache blocks").
        knob: the ``LLM`` argument that raises ``capacity`` ("num_blocks").
    """

    def __init__(self, capacity: int, what: str, knob: str) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"{knob}: expected an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.what = what
        self.knob = knob
        self._high_water = 0
        # Popped from the end, so the most recently freed id is reused first.
        self._returned: list[int] = []

    @property
    def num_free(self) -> int:
        return self.capacity - self._high_water + len(self._returned)

    def check_fits(self, needed: int, context: str) -> None:
        """Raise ``CacheFullError`` unless ``needed`` ids can be allocated right now."""
        free = self.num_free
        if needed > free:
            raise CacheFullError(
                f"{context} needs {needed} {self.what} but only {free} of the "
                f"{self.capacity} that exist are free",
                self.knob,
                self.capacity - free + needed,
            )

    def allocate(self, n: int, context: str) -> list[int]:
        """``n`` ids, or ``CacheFullError`` (nothing is taken then)."""
        self.check_fits(n, context)
        reused = min(n, len(self._returned))
        taken = self._returned[len(self._returned) - reused :][::-1]
        del self._returned[len(self._returned) - reused :]
        fresh = n - reused
        taken += range(self._high_water, self._high_water + fresh)
        self._high_water += fresh
        return taken

    def free(self, ids: list[int]) -> None:
        """Return ids to the pool (the most recently freed are reused first)."""
        self._returned.extend(reversed(ids))


def blocks_for(num_tokens: int, block_size: int, dcp_size: int) -> int:
    """Block-table columns (and physical blocks per rank) a ``num_tokens`` sequence needs."""
    per_block = block_size * dcp_size
    return -(-num_tokens // per_block)


def resolve_cache_dtype(kv_cache_dtype: str | torch.dtype | None, model_dtype: torch.dtype):
    """The latent-cache dtype for ``LLM(kv_cache_dtype=...)``.

    ``None``/``"auto"``: the model dtype. ``"fp8"``: ``float8_e4m3fn`` (``"fp8_e4m3fnuz"`` for
    MI300's flavour), stored at scale 1 and read by the backends that list it in their
    capabilities. A torch dtype is taken as is.
    """
    names = {
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3fn": torch.float8_e4m3fn,
        "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return model_dtype
    if isinstance(kv_cache_dtype, torch.dtype):
        dtype = kv_cache_dtype
    elif kv_cache_dtype in names:
        dtype = names[kv_cache_dtype]
    else:
        raise ValueError(
            f"kv_cache_dtype: expected 'auto', one of {sorted(names)} or a torch dtype, "
            f"got {kv_cache_dtype!r}"
        )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES):
        raise ValueError(f"kv_cache_dtype: {dtype} is not a latent-cache dtype")
    return dtype
