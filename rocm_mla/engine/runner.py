"""The runner: the one place that turns requests into per-step forward metadata.

Positions, slot mappings, block tables, ``seq_lens`` and the DCP rank-local lengths are
computed here and nowhere else (contract 2 of docs/architecture.md): the slot mapping and the local
lengths come from ``rocm_mla.dcp`` (``slot_mapping``, ``DecodeMetadata.build``), never
re-derived. Every rank holds an identical ``Runner`` fed the same requests in the same order,
so block ids and state slots agree across ranks; only the DCP rank changes what a rank writes
(its own tokens) and reads (its own shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rocm_mla.dcp import DecodeMetadata, check_block_size, plan_step_decode, slot_mapping
from rocm_mla.engine.cache import FreeList, blocks_for
from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.platform import resolve_device


@dataclass(frozen=True)
class DecodeAttention:
    """The MLA kernel call a stage makes, as the runner needs it to plan each decode step.

    ``num_heads`` is what the kernel sees: this TP rank's heads times the DCP size (the layer
    gathers the DCP group's heads). ``q_dtype``/``kv_dtype`` are the query and cache dtypes
    of that call; ``backend`` is the name the layers were built with (None: env / auto).
    """

    num_heads: int
    head_dim_v: int
    rope_dim: int
    kv_dtype: torch.dtype
    q_dtype: torch.dtype
    backend: str | None = None


@dataclass
class Request:
    """One sequence: its tokens so far, its cache blocks and its KDA state slot.

    ``tokens`` is the prompt followed by the generated tokens; ``num_cached`` of them have
    been written to the caches (the newest generated token has not, until the next step).
    """

    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    finished: bool = False

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Runner:
    """Request state and step metadata for one rank.

    Args:
        num_blocks: physical KV blocks per MLA layer on this rank (``LLM(num_blocks=)``).
        block_size: tokens per physical block.
        max_num_seqs: KDA state slots, i.e. requests in flight at once (``LLM(max_num_seqs=)``).
        dcp_size, dcp_rank, dcp_interleave: this rank's decode-context-parallel layout.
        device: where the metadata tensors live (``"cuda"``: the current GPU, resolved once
            here, as the step's tensors and plans are compared by the resolved device).
        attention: the stage's MLA kernel call; when given, every uniform decode step carries
            one ``rocm_mla.plan_decode`` plan that all MLA layers of the step share.

    Attributes:
        fault_flag: ``[1]`` int32 on ``device``, the worker's one out-of-bounds flag: zeroed
            on the device as each step is built and handed to every MLA layer in
            ``ForwardMetadata.fault_flag``; the worker reads it at the step's existing sync.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
        device: torch.device | str = "cpu",
        attention: DecodeAttention | None = None,
    ) -> None:
        check_block_size(block_size, dcp_interleave)
        self.blocks = FreeList(num_blocks, "KV cache blocks", "num_blocks")
        self.slots = FreeList(max_num_seqs, "sequence slots (KDA state rows)", "max_num_seqs")
        self.block_size = block_size
        self.dcp_size, self.dcp_rank, self.dcp_interleave = dcp_size, dcp_rank, dcp_interleave
        self.device = resolve_device(device)
        self.attention = attention
        self.fault_flag = torch.zeros(1, dtype=torch.int32, device=self.device)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size, self.dcp_size)

    def admit(self, prompts: list[list[int]], max_new_tokens: int) -> list[Request]:
        """Take a batch of prompts: state slots and prompt blocks now, the rest as they grow.

        The whole batch's worst case (every request running to ``max_new_tokens``) must fit,
        so a step can never run out of blocks halfway; otherwise ``CacheFullError`` says how
        many blocks were needed, how many exist, and which ``LLM`` argument raises the limit.
        Nothing is allocated when it raises.
        """
        # The last generated token is sampled, never fed back, so it takes no cache row.
        worst = [len(p) + max(max_new_tokens - 1, 0) for p in prompts]
        need = sum(self.blocks_needed(n) for n in worst)
        context = (
            f"a batch of {len(prompts)} requests of up to {max(worst)} cached tokens each "
            f"(block_size {self.block_size}"
            + (f" x dcp {self.dcp_size} per block-table column" if self.dcp_size > 1 else "")
            + ")"
        )
        self.blocks.check_fits(need, context)
        self.slots.check_fits(len(prompts), f"a batch of {len(prompts)} requests")
        requests = []
        for i, prompt in enumerate(prompts):
            (slot,) = self.slots.allocate(1, f"request {i}")
            req = Request(i, list(prompt), len(prompt), max_new_tokens, slot)
            req.blocks = self.blocks.allocate(self.blocks_needed(len(prompt)), context)
            requests.append(req)
        return requests

    def finish(self, req: Request) -> None:
        """Return a finished request's blocks and state slot to the pools."""
        if not req.finished:
            self.blocks.free(req.blocks)
            self.slots.free([req.slot])
            req.blocks, req.finished = [], True

    def prefill(self, requests: list[Request]) -> tuple[ForwardMetadata, torch.Tensor]:
        """Metadata and ``input_ids [T]`` for the whole prompts of fresh requests."""
        return self._step(requests, [r.prompt_len for r in requests])

    def decode(self, requests: list[Request]) -> tuple[ForwardMetadata, torch.Tensor]:
        """Metadata and ``input_ids [B]`` feeding each request its newest token."""
        for req in requests:
            grow = self.blocks_needed(len(req.tokens)) - len(req.blocks)
            req.blocks += self.blocks.allocate(grow, f"request {req.index}")
        return self._step(requests, [1] * len(requests))

    def _step(
        self, requests: list[Request], num_new: list[int]
    ) -> tuple[ForwardMetadata, torch.Tensor]:
        # Everything is computed on the host from the runner's own numbers and moved to the
        # device once: building the step reads nothing back from the device.
        ids, positions, req_indices, starts = [], [], [], [0]
        context = [req.num_cached for req in requests]
        for b, (req, n) in enumerate(zip(requests, num_new, strict=True)):
            ctx = req.num_cached
            ids += req.tokens[ctx : ctx + n]
            positions += range(ctx, ctx + n)
            req_indices += [b] * n
            starts.append(starts[-1] + n)
            req.num_cached = ctx + n
        width = max(len(r.blocks) for r in requests)
        table = torch.zeros(len(requests), width, dtype=torch.int32)
        for b, req in enumerate(requests):
            table[b, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        seq_lens = torch.tensor([r.num_cached for r in requests], dtype=torch.int32)
        slots = slot_mapping(
            pos,
            torch.tensor(req_indices, dtype=torch.int64),
            table,
            self.block_size,
            self.dcp_size,
            self.dcp_rank,
            self.dcp_interleave,
        )
        decoding = any(c > 0 for c in context)
        uniform = len(set(num_new)) == 1
        plan = None
        if decoding and uniform and self.attention is not None:
            a = self.attention
            plan = plan_step_decode(
                seq_lens,
                num_new[0],
                num_heads=a.num_heads,
                head_dim_v=a.head_dim_v,
                rope_dim=a.rope_dim,
                kv_dtype=a.kv_dtype,
                q_dtype=a.q_dtype,
                device=self.device,
                backend=a.backend,
                dcp_world_size=self.dcp_size,
                dcp_rank=self.dcp_rank,
                dcp_interleave=self.dcp_interleave,
            )
        dev = self.device
        # Queued on the device like the step itself: no sync, and the previous step's bits
        # were read at its sync already.
        self.fault_flag.zero_()
        table, seq_lens = table.to(dev), seq_lens.to(dev)
        dcp = None
        if self.dcp_size > 1 and decoding:
            dcp = DecodeMetadata.build(
                table, seq_lens, num_new[0], self.dcp_size, self.dcp_rank, self.dcp_interleave
            )
        meta = ForwardMetadata(
            positions=pos.to(dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=seq_lens,
            slot_mapping=slots.to(dev),
            block_tables=table,
            state_slots=torch.tensor([r.slot for r in requests], dtype=torch.int64, device=dev),
            num_new=list(num_new),
            context_lens=context,
            write_rows=(slots >= 0).nonzero()[:, 0].to(dev),
            fresh=torch.tensor([c == 0 for c in context], device=dev),
            dcp=dcp,
            decode_plan=plan,
            fault_flag=self.fault_flag,
        )
        return meta, torch.tensor(ids, dtype=torch.int64, device=dev)
