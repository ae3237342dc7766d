"""Decode context parallelism (DCP): the KV cache of every request is sharded by token.

With DCP size ``N`` and interleave ``I``, token position ``p`` lives on rank ``(p // I) % N``
(``I`` consecutive tokens per rank, round robin). Each rank stores its tokens as a dense prefix
of its own paged cache, so its shard is an ordinary paged cache of ``local(L)`` tokens.

Two sides, one contract (contract 2 of docs/architecture.md), in two modules:

* **Runner side**, ``rocm_mla.dcp.layout`` (``local_seq_lens``, ``owner_rank``, ``slot_mapping``,
  ``verify_local_seq_lens``, ``DecodeMetadata.build``): the model runner is the single producer
  of the rank-local lengths and of the token -> local-slot mapping. The local-length formula is
  written once, in ``local_seq_lens``.
* **Layer side**, ``rocm_mla.dcp.attention`` (``dcp_mla_decode``): gathers the query heads
  of the DCP group, decodes every gathered head over this rank's shard with the runner's
  local lengths, and combines the partials by their LSEs. When the group has more than one
  rank and the runner's lengths are missing it raises; it never derives them (upstream
  removed exactly such a fallback because it hid runner regressions).
"""

from rocm_mla.dcp.attention import combine_partials, dcp_mla_decode, gather_query_heads
from rocm_mla.dcp.layout import (
    RUNNER_CONTRACT,
    DecodeMetadata,
    check_block_size,
    local_seq_lens,
    owner_rank,
    plan_step_decode,
    slot_mapping,
    verify_local_seq_lens,
)

__all__ = [
    "RUNNER_CONTRACT",
    "DecodeMetadata",
    "check_block_size",
    "combine_partials",
    "dcp_mla_decode",
    "gather_query_heads",
    "local_seq_lens",
    "owner_rank",
    "plan_step_decode",
    "slot_mapping",
    "verify_local_seq_lens",
]
