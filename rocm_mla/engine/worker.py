"""Stage workers: one per (PP stage, TP rank), all running the same generate loop (SPMD).

Each worker holds its stage's model shard, that stage's caches and an identical ``Runner``.
A generate call runs on every rank with the same arguments: the first stage embeds, every
stage hands its ``StageIO`` (hidden state + residual, or with Attention Residuals the
open block and the bank of completed blocks) to the same TP rank of the next stage with
point-to-point ``send``/``recv``, the last stage samples on its first TP rank and broadcasts
the new tokens to every rank, so all runners advance in lockstep. TP all-reduces and the DCP
decode run inside the model on the groups of ``rocm_mla.distributed``.

``python -m rocm_mla.engine.worker`` is the long-lived process body that ``LLM`` starts (a
fresh interpreter that never imports the caller's ``__main__``, so scripts need no main
guard). It reads its ``WorkerSpec`` from stdin, connects back to the parent on 127.0.0.1
(authenticated by a one-time token), joins the process group through the parent's store, and
then runs the parent's commands; under ``torchrun`` every process builds a ``StageWorker``
itself (``LLM(..., launcher="torchrun")``).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from rocm_mla.distributed import ParallelState, connect_store, init_parallel, token_connect
from rocm_mla.engine.cache import CacheFullError, resolve_cache_dtype
from rocm_mla.engine.graphs import DecodeGraphs
from rocm_mla.engine.prompts import check_prompts
from rocm_mla.engine.runner import DecodeAttention, Request, Runner
from rocm_mla.inputs import FP8_DTYPES, raise_on_fault
from rocm_mla.models.kimi_k3 import KimiK3ForCausalLM, StageIO, load_model
from rocm_mla.models.kimi_k3.attn_res import closes_block


@dataclass(frozen=True)
class EngineOptions:
    """Everything a worker needs besides the checkpoint path (picklable, sent at spawn)."""

    pp: int = 1
    tp: int = 1
    dcp: int = 1
    dcp_interleave: int = 1
    backend: str | None = None
    dtype: torch.dtype | None = None
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 16
    kv_cache_dtype: str | torch.dtype | None = None
    seed: int = 0
    #: never capture decode steps in CUDA/HIP graphs (``rocm_mla.engine.graphs``)
    enforce_eager: bool = False


def _model_dtype(model: KimiK3ForCausalLM) -> torch.dtype:
    """The activations' dtype (norm weights follow the load dtype; routers stay fp32)."""
    return next(iter(model.model.layers.values())).input_layernorm.weight.dtype


class StageComm:
    """Point-to-point stage handoff and the sampler's broadcast, on the world group."""

    def __init__(self, state: ParallelState, model: KimiK3ForCausalLM) -> None:
        tp, rank = state.layout.tp, state.rank
        self.prev = rank - tp if not model.is_first else None
        self.next = rank + tp if not model.is_last else None
        self.sampler = (state.layout.pp - 1) * tp
        self.rank = rank
        config = model.config
        self.hidden_size = config.hidden_size
        self.dtype = _model_dtype(model)
        self.device = state.device
        start = model.layer_range[0]
        block = config.attn_res_block_size
        # The bank a stage receives holds the blocks closed by every earlier layer.
        self.bank_blocks = (
            None if block is None else sum(closes_block(layer, block) for layer in range(start))
        )

    def recv(self, num_tokens: int) -> StageIO:
        """The previous stage's ``StageIO`` for ``num_tokens`` packed tokens."""
        d = self.hidden_size
        hidden = torch.empty(num_tokens, d, dtype=self.dtype, device=self.device)
        if self.bank_blocks is None:
            residual = torch.empty(num_tokens, d, dtype=self.dtype, device=self.device)
        else:
            residual = torch.empty(
                num_tokens, self.bank_blocks, d, dtype=self.dtype, device=self.device
            )
        dist.recv(hidden, src=self.prev)
        if residual.numel():
            dist.recv(residual, src=self.prev)
        return StageIO(hidden, residual)

    def send(self, io: StageIO) -> None:
        dist.send(io.hidden.contiguous(), dst=self.next)
        if io.residual is not None and io.residual.numel():
            dist.send(io.residual.contiguous(), dst=self.next)

    def share_tokens(self, ids: torch.Tensor | None, count: int) -> torch.Tensor:
        """The sampler's ``count`` new token ids ``[count]`` int64, on every rank."""
        if ids is None:
            ids = torch.empty(count, dtype=torch.int64, device=self.device)
        dist.broadcast(ids, src=self.sampler)
        return ids

    def share_object(self, obj: Any) -> Any:
        """The sampler's ``obj`` on every rank (for results only the last stage has)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.sampler)
        return box[0]


class StageWorker:
    """One rank's model shard, caches and runner; ``generate``/``score`` run on every rank.

    Args:
        model: this stage/TP rank's model (weights loaded, absorbed).
        options: the engine options.
        comm: the process-group transport; None when a single process holds the whole model.
        dcp_rank: this rank's place in its DCP group.
        device: where caches and metadata live.
    """

    def __init__(
        self,
        model: KimiK3ForCausalLM,
        options: EngineOptions,
        comm: StageComm | None = None,
        dcp_rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model, self.options, self.comm = model, options, comm
        kv_dtype = resolve_cache_dtype(options.kv_cache_dtype, _model_dtype(model))
        config = model.config
        # The MLA layers hand the kernel their absorbed queries in the cache's dtype (in the
        # model's for an fp8 cache) over this rank's heads gathered across the DCP group.
        attention = DecodeAttention(
            num_heads=config.num_attention_heads // options.tp * options.dcp,
            head_dim_v=config.kv_lora_rank,
            rope_dim=config.qk_rope_head_dim,
            kv_dtype=kv_dtype,
            q_dtype=_model_dtype(model) if kv_dtype in FP8_DTYPES else kv_dtype,
            backend=options.backend,
        )
        self.runner = Runner(
            options.num_blocks,
            options.block_size,
            options.max_num_seqs,
            options.dcp,
            dcp_rank,
            options.dcp_interleave,
            device,
            attention,
        )
        # A single process on a GPU replays its decode steps from graphs; their padding rows
        # write to one extra block and state slot that the runner never hands out.
        self.graphs: DecodeGraphs | None = None
        capture = comm is None and torch.device(device).type == "cuda" and not options.enforce_eager
        spare = 1 if capture else 0
        self.caches = model.make_caches(
            options.num_blocks + spare,
            options.block_size,
            options.max_num_seqs + spare,
            device=device,
            kv_dtype=kv_dtype,
        )
        if capture:
            self.graphs = DecodeGraphs(
                lambda meta, ids: self._forward(meta, ids),
                kv_dtype=attention.kv_dtype,
                q_dtype=attention.q_dtype,
                num_heads=attention.num_heads,
                head_dim_v=attention.head_dim_v,
                rope_dim=attention.rope_dim,
                backend=attention.backend,
                block_size=options.block_size,
                max_seqlen=config.max_position_embeddings,
                max_batch=options.max_num_seqs,
                trash_block=options.num_blocks,
                trash_slot=options.max_num_seqs,
                device=device,
            )
        self.is_sampler = comm is None or comm.rank == comm.sampler
        self.generator = torch.Generator(device=device).manual_seed(options.seed)

    @classmethod
    def load(
        cls,
        path: str,
        options: EngineOptions,
        state: ParallelState | None = None,
        device: torch.device | str = "cpu",
    ) -> StageWorker:
        """Load this rank's shard of the checkpoint at ``path`` (``state`` None: all of it)."""
        if state is None:
            model = load_model(path, dtype=options.dtype, device=device, backend=options.backend)
            return cls(model, options, None, 0, device)
        dcp_group = state.dcp_group if options.dcp > 1 else None
        model = load_model(
            path,
            pp_rank=state.pp_rank,
            pp_size=options.pp,
            tp_rank=state.tp_rank,
            tp_size=options.tp,
            all_reduce=state.tp_group if options.tp > 1 else None,
            dtype=options.dtype,
            device=state.device,
            backend=options.backend,
            dcp_group=dcp_group,
        )
        return cls(model, options, StageComm(state, model), state.dcp_rank, state.device)

    def _forward(
        self, meta, input_ids: torch.Tensor, logits_rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """This stage's part of one step; on the last stage the logits of ``logits_rows``
        (``[R, vocab]``; all ``T`` rows when None), else None."""
        model = self.model
        if model.is_first:
            out = model(meta, self.caches, input_ids=input_ids, logits_rows=logits_rows)
        else:
            intermediate = self.comm.recv(input_ids.shape[0])
            out = model(meta, self.caches, intermediate=intermediate, logits_rows=logits_rows)
        if model.is_last:
            return out
        self.comm.send(out)
        return None

    def _next_tokens(
        self, logits: torch.Tensor | None, count: int, temperature: float, step: str
    ) -> list[int]:
        """Sample ``count`` tokens from the last rows' logits ``[count, vocab]`` (present on
        last-stage ranks) on the sampler; every rank gets them.

        This is the step's one host sync; the runner's fault flag comes back in the same
        copy, and a set bit raises ``KVBoundsError`` naming ``step``."""
        ids = None
        if self.is_sampler:
            if temperature == 0.0:
                ids = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                ids = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        if self.comm is not None:
            ids = self.comm.share_tokens(ids, count)
        *tokens, fault = torch.cat([ids, self.runner.fault_flag.to(ids.dtype)]).tolist()
        if fault:
            rank = "" if self.comm is None else f", rank {self.comm.rank}"
            raise_on_fault(torch.tensor([fault]), f"generate, {step}{rank}")
        return tokens

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_token_ids: Collection[int] = (),
        progress: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """New tokens per prompt; a request stops at EOS (kept) or ``max_new_tokens``.

        Every rank calls this with the same arguments. A finished request's blocks and state
        slot go back to the pools at once while the others keep decoding. ``progress(step,
        max_new_tokens)`` is called after each sampled step. ``prompts`` are checked as
        ``LLM.generate`` checks them (``rocm_mla.engine.prompts``).
        """
        prompts = check_prompts(self.model.config, prompts, max_new_tokens)
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        requests = self.runner.admit(prompts, max_new_tokens)
        try:
            meta, ids = self.runner.prefill(requests)
            last_rows = meta.query_start_loc[1:].long() - 1
            logits = self._forward(meta, ids, last_rows)
            new = self._next_tokens(logits, len(requests), temperature, "prefill")
            active = requests
            step = 1
            while True:
                if progress is not None:
                    progress(step, max_new_tokens)
                step += 1
                still: list[Request] = []
                for req, token in zip(active, new, strict=True):
                    req.tokens.append(token)
                    if token in eos_token_ids or len(req.output) == req.max_new_tokens:
                        self.runner.finish(req)
                    else:
                        still.append(req)
                active = still
                if not active:
                    break
                meta, ids = self.runner.decode(active)
                if self.graphs is not None and self.graphs.can_run(meta):
                    logits = self.graphs.run(meta, ids)
                else:
                    logits = self._forward(meta, ids)
                new = self._next_tokens(logits, len(active), temperature, f"decode step {step - 1}")
        finally:
            for req in requests:
                self.runner.finish(req)
        return [req.output for req in requests]

    @torch.no_grad()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor] | None:
        """Prefill logits ``[len, vocab]`` per prompt on last-stage ranks (None elsewhere)."""
        prompts = check_prompts(self.model.config, prompts)
        requests = self.runner.admit(prompts, 0)
        try:
            meta, ids = self.runner.prefill(requests)
            logits = self._forward(meta, ids)
        finally:
            for req in requests:
                self.runner.finish(req)
        if logits is None:
            return None
        return list(logits.cpu().split([len(p) for p in prompts]))


@dataclass(frozen=True)
class WorkerSpec:
    """What the parent hands one worker process on its stdin (pickled)."""

    rank: int
    path: str
    options: EngineOptions
    backend: str
    control_port: int
    store_port: int
    token: bytes
    parent_pid: int
    torch_threads: int | None
    collective_timeout_s: float


#: Purpose byte of a worker's control connection to the parent (``TokenListener``).
CONTROL_PURPOSE = b"C"
#: Seconds between a busy worker's heartbeats; the parent names a rank whose heartbeats stop.
HEARTBEAT_S = 1.0
#: Seconds between progress messages of the sampler (the parent throttles what it prints).
PROGRESS_S = 0.5


class ParentLink:
    """This worker's connection to the parent: locked sends, heartbeats while busy, and an
    exit as soon as the parent is gone (even while blocked in a collective)."""

    def __init__(self, conn: Connection, parent_pid: int) -> None:
        self.conn = conn
        self.parent_pid = parent_pid
        self.busy = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="rocm-mla-heartbeat", daemon=True).start()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def _watch(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            if os.getppid() != self.parent_pid:
                os._exit(1)  # orphaned: the parent died without stopping us
            if self.busy.is_set():
                try:
                    self.send(("heartbeat",))
                except OSError:
                    os._exit(1)


def _run(spec: WorkerSpec, link: ParentLink) -> None:
    """Join the group, load, report ready, then serve commands until "stop" or EOF."""
    options = spec.options
    store = connect_store(spec.store_port, spec.token, spec.rank, spec.collective_timeout_s)
    link.busy.set()
    state = init_parallel(
        options.pp,
        options.tp,
        options.dcp,
        rank=spec.rank,
        world_size=options.pp * options.tp,
        backend=spec.backend,
        timeout_s=spec.collective_timeout_s,
        store=store,
    )
    worker = StageWorker.load(spec.path, options, state, state.device)
    link.busy.clear()
    link.send(("ready",))
    fault_pending = False
    last_progress = 0.0

    def progress(step: int, total: int) -> None:
        nonlocal last_progress
        now = time.monotonic()
        if now - last_progress >= PROGRESS_S:
            last_progress = now
            link.send(("progress", step, total))

    while True:
        try:
            op, args = link.conn.recv()
        except EOFError:
            return
        if op == "stop":
            return
        if op == "fault":
            # Test hook: this rank raises at its next call while the others block in the
            # step's collectives, the way a real worker bug strands its peers.
            fault_pending = args == spec.rank
            continue
        link.busy.set()
        if fault_pending:
            raise RuntimeError(f"injected fault on rank {spec.rank} (LLM._inject_fault)")
        if op == "generate":
            args = (*args, progress if worker.is_sampler else None)
        elif op != "score":
            raise ValueError(f"worker: unknown operation {op!r}")
        try:
            value = getattr(worker, op)(*args)
        except CacheFullError as exc:
            # Raised by admission on every rank alike before any communication: the
            # workers stay up.
            outcome: tuple = ("rejected", exc.detail, exc.knob, exc.minimum)
        else:
            outcome = ("ok", pickle.dumps(value) if worker.is_sampler else None)
        link.busy.clear()
        link.send(("done", outcome))


def main() -> None:
    """Entry point of ``python -m rocm_mla.engine.worker`` (started by ``LLM`` only)."""
    # The parent owns Ctrl-C: it stops the workers itself, so they print nothing of their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    torch.set_grad_enabled(False)
    conn = token_connect(spec.control_port, spec.token, CONTROL_PURPOSE, spec.rank)
    link = ParentLink(conn, spec.parent_pid)
    try:
        _run(spec, link)
    except BaseException:
        # Stamped so that the parent can tell the rank that failed first from the peers its
        # exit broke (same host, same clock).
        try:
            link.send(("error", time.time(), traceback.format_exc()))
        finally:
            os._exit(1)
    # Exit without tearing the group down: the peers are stopping too, and a teardown that
    # waits on them is the one thing that could hang here.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
