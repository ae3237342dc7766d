"""Decode steps captured once per padded batch size and replayed (CUDA/HIP graphs).

A decode step of a single-process engine launches a few hundred small kernels; on a GPU the
launches, not the math, bound a small batch. So the step is captured once per batch-size
bucket (1, 2, 4, 8, ... up to ``max_num_seqs``) into a ``torch.cuda.CUDAGraph`` and replayed:
the runner's metadata is copied into the bucket's static buffers, the graph replays, and the
first ``B`` rows of its logits are the step's.

What makes the step capturable (nothing in it reads a device value back to the host):

- the MLA layers launch with one ``plan_decode(..., graph_max_seqlen=)`` plan per bucket,
  valid for any lengths up to the engine's longest sequence; each step ``replan_decode``
  rewrites the plan's balanced schedule (Triton) from the step's lengths, on the device and
  outside the graph, so a replay is balanced by the lengths it runs;
- the MoE takes its dense schedule while capturing (``MoE.routed``);
- the layers branch on host lists (``ForwardMetadata.num_new``), never on tensors.

Padding rows are requests of length 0 (their attention is empty) whose cache writes go to
one extra KV block and one extra KDA state slot that the allocator never hands out
(``trash_block`` / ``trash_slot``): the caches are made one larger for this.

Only single-process engines capture (one GPU: ``pp = tp = dcp = 1``); ``enforce_eager``
turns capture off. Prefill always runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rocm_mla.api import plan_decode, replan_decode
from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.platform import resolve_device

#: Batch-size buckets; the largest is replaced by ``max_num_seqs``.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: ``capture(fn) -> (replay, output)``: records ``fn`` and returns a callable that reruns it on
#: the same buffers, and ``fn``'s output tensor (which each replay overwrites).
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_graph_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``fn`` in a ``torch.cuda.CUDAGraph`` after one warm-up run on a side stream
    (Triton compiles and the allocator grows there, outside the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


@dataclass
class _Bucket:
    """One captured batch size: its static inputs, replay function and logits buffer."""

    size: int
    input_ids: torch.Tensor  #: [Bp] int64
    meta: ForwardMetadata  #: static tensors the graph reads
    replay: Callable[[], None] | None = None
    logits: torch.Tensor | None = None  #: [Bp, vocab], overwritten by each replay


class DecodeGraphs:
    """Captured decode steps of one single-process ``StageWorker``.

    Args:
        forward: ``forward(meta, input_ids) -> logits [T, vocab]``, the worker's step.
        kv_dtype, q_dtype: the MLA kernel call's cache and query dtypes.
        num_heads, head_dim_v, rope_dim: the MLA kernel call's geometry.
        backend: the MLA backend name the model was built with (None: env / auto).
        block_size: tokens per KV block.
        max_seqlen: the longest sequence a request can reach (prompt + new tokens); the
            plans and block tables of the buckets cover it.
        max_batch: the largest decode batch (``max_num_seqs``).
        trash_block, trash_slot: the KV block and KDA state slot padding rows write to.
        device: the GPU (``"cuda"``: the current one, resolved once here).
        capture: how to record a step (``cuda_graph_capture``; tests pass their own).
    """

    def __init__(
        self,
        forward: Callable[[ForwardMetadata, torch.Tensor], torch.Tensor],
        *,
        kv_dtype: torch.dtype,
        q_dtype: torch.dtype,
        num_heads: int,
        head_dim_v: int,
        rope_dim: int,
        backend: str | None,
        block_size: int,
        max_seqlen: int,
        max_batch: int,
        trash_block: int,
        trash_slot: int,
        device: torch.device | str,
        capture: Capture = cuda_graph_capture,
    ) -> None:
        self.forward = forward
        self.kv_dtype, self.q_dtype = kv_dtype, q_dtype
        self.num_heads, self.head_dim_v, self.rope_dim = num_heads, head_dim_v, rope_dim
        self.backend = backend
        self.block_size = block_size
        self.max_seqlen = max_seqlen
        self.max_blocks = -(-max_seqlen // block_size)
        self.sizes = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.trash_block, self.trash_slot = trash_block, trash_slot
        self.device = resolve_device(device)
        self.capture = capture
        self.buckets: dict[int, _Bucket] = {}

    def bucket_size(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` requests (None: larger than any)."""
        return next((b for b in self.sizes if b >= batch), None)

    def can_run(self, meta: ForwardMetadata) -> bool:
        """Whether this step is a plain decode (one new token per request, each with context)
        of a batch some bucket holds, within the lengths the plans cover."""
        return (
            all(n == 1 for n in meta.num_new)
            and all(c > 0 for c in meta.context_lens)
            and self.bucket_size(len(meta.num_new)) is not None
            and meta.block_tables.shape[1] <= self.max_blocks
            and meta.dcp is None
        )

    def run(self, meta: ForwardMetadata, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's logits ``[B, vocab]`` from the bucket's graph (captured on first use)."""
        batch = len(meta.num_new)
        size = self.bucket_size(batch)
        bucket = self.buckets.get(size)
        if bucket is None:
            bucket = self.buckets[size] = self._capture(size)
        self._load(bucket, meta, input_ids)
        bucket.replay()
        if meta.fault_flag is not None:
            # The graph ORs into its own static flag; hand the bits on to the step's.
            meta.fault_flag.bitwise_or_(bucket.meta.fault_flag)
        return bucket.logits[:batch]

    def _static(self, size: int) -> _Bucket:
        dev = self.device
        plan = plan_decode(
            torch.zeros(size, dtype=torch.int32),
            q_len=1,
            num_heads=self.num_heads,
            head_dim_v=self.head_dim_v,
            rope_dim=self.rope_dim,
            kv_dtype=self.kv_dtype,
            q_dtype=self.q_dtype,
            device=dev,
            graph_max_seqlen=self.max_blocks * self.block_size,
            backend=self.backend,
            return_lse=False,
        )
        meta = ForwardMetadata(
            positions=torch.zeros(size, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(size, dtype=torch.int32, device=dev),
            slot_mapping=torch.full(
                (size,), self.trash_block * self.block_size, dtype=torch.int64, device=dev
            ),
            block_tables=torch.full(
                (size, self.max_blocks), self.trash_block, dtype=torch.int32, device=dev
            ),
            state_slots=torch.full((size,), self.trash_slot, dtype=torch.int64, device=dev),
            # Host lists for the layers' branches: a uniform decode over cached context.
            num_new=[1] * size,
            context_lens=[1] * size,
            write_rows=torch.arange(size, dtype=torch.int64, device=dev),
            fresh=torch.zeros(size, dtype=torch.bool, device=dev),
            decode_plan=plan,
            fault_flag=torch.zeros(1, dtype=torch.int32, device=dev),
        )
        return _Bucket(size, torch.zeros(size, dtype=torch.int64, device=dev), meta)

    def _capture(self, size: int) -> _Bucket:
        bucket = self._static(size)
        # Every row is padding while recording: the warm-up run writes only trash rows.
        bucket.replay, bucket.logits = self.capture(
            lambda: self.forward(bucket.meta, bucket.input_ids)
        )
        return bucket

    def _load(self, bucket: _Bucket, meta: ForwardMetadata, input_ids: torch.Tensor) -> None:
        """Copy the step into the static buffers; rows past ``B`` become padding again."""
        b, s = len(meta.num_new), bucket.meta
        width = meta.block_tables.shape[1]
        s.positions[:b].copy_(meta.positions)
        s.positions[b:].zero_()
        s.seq_lens[:b].copy_(meta.seq_lens)
        s.seq_lens[b:].zero_()
        # The bucket's schedule from this step's lengths, into the tables the graph reads.
        replan_decode(s.decode_plan, s.seq_lens)
        s.slot_mapping[:b].copy_(meta.slot_mapping)
        s.slot_mapping[b:].fill_(self.trash_block * self.block_size)
        s.block_tables[:b, :width].copy_(meta.block_tables)
        s.block_tables[:b, width:].fill_(self.trash_block)
        s.block_tables[b:].fill_(self.trash_block)
        s.state_slots[:b].copy_(meta.state_slots)
        s.state_slots[b:].fill_(self.trash_slot)
        s.fault_flag.zero_()
        bucket.input_ids[:b].copy_(input_ids)
        bucket.input_ids[b:].zero_()
