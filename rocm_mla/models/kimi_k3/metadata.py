"""What one forward step needs to know about its requests and their paged caches.

The engine fills it; the model only reads it. Tokens of the ``B`` requests are packed
request-major into ``T`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rocm_mla.dcp import DecodeMetadata
from rocm_mla.inputs import DecodePlan


@dataclass
class ForwardMetadata:
    """Per-step batch layout.

    Attributes:
        positions: ``[T]`` int64, each new token's position in its sequence.
        query_start_loc: ``[B + 1]`` int32, request ``b``'s new tokens are rows
            ``[query_start_loc[b], query_start_loc[b + 1])``.
        seq_lens: ``[B]`` int32, tokens per request after this step (context + new).
        slot_mapping: ``[T]`` int64, flat latent-cache slot ``block * block_size + offset`` of
            each new token (the same for every MLA layer of a stage).
        block_tables: ``[B, max_blocks]`` int32, the request's cache blocks in order.
        state_slots: ``[B]`` int64, each request's row in the KDA conv/recurrent state caches.
        dcp: with decode context parallelism, the runner's ``DecodeMetadata`` for this rank
            (``DecodeMetadata.build``: rank-local lengths of every query row); None without
            DCP. ``slot_mapping`` is then rank-local too: -1 for tokens another rank owns.
        num_new: new tokens per request, on the host (the same as ``query_start_loc``'s
            steps; the layers branch on it without reading a device tensor).
        context_lens: tokens each request had in its caches before this step, on the host.
        write_rows: ``[W]`` int64, the rows of ``T`` whose latent this rank writes (all of
            them without DCP), so the cache write needs no boolean mask (a host sync).
        fresh: ``[B]`` bool, requests with no context (their KDA state starts from zero).
        decode_plan: the step's ``rocm_mla.plan_decode`` for the MLA decode, shared by every
            MLA layer; None when the step is not a uniform decode (each layer then plans).
        fault_flag: ``[1]`` int32 on the device, the runner's (one per worker, zeroed each
            step): every MLA layer's decode ORs its ``rocm_mla.FAULT_*`` bits into it, and the
            step's existing host sync reads it. None: nothing reports.
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    num_new: list[int]
    context_lens: list[int]
    write_rows: torch.Tensor
    fresh: torch.Tensor
    dcp: DecodeMetadata | None = None
    decode_plan: DecodePlan | None = None
    fault_flag: torch.Tensor | None = None

    @property
    def query_starts(self) -> list[int]:
        """``query_start_loc`` on the host: request ``b``'s rows are ``[s[b], s[b + 1])``."""
        starts = [0]
        for n in self.num_new:
            starts.append(starts[-1] + n)
        return starts
