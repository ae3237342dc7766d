"""``rocm_mla.LLM``: generate and score with a Kimi-K3 / Kimi-Linear checkpoint over PP x TP x DCP.

``pp * tp == 1`` runs in this process. Otherwise ``LLM`` starts ``pp * tp`` long-lived
worker processes (spawned, gloo on CPU, nccl/RCCL on GPU) through
``rocm_mla.distributed.launch``, sends each call to all of them over per-rank queues and
gets the result back from the sampler rank; workers are never re-spawned per call. A worker
that raises makes the call raise ``WorkerError`` naming the rank; the others are terminated.

Multi-node, or to own the processes yourself: start every rank with ``torchrun`` and build
the engine with ``launcher="torchrun"`` in each; every rank then calls ``generate``/``score``
with the same arguments and gets the same result::

    torchrun --nproc-per-node 4 -m rocm_mla.cli generate --torchrun --model DIR \\
        --pp 2 --tp 2 --dcp 2 --prompt-ids 1,2,3

"""

from __future__ import annotations

import os
import pickle
import queue
import threading
from collections.abc import Collection
from pathlib import Path

import torch
import torch.multiprocessing as mp

from rocm_mla.backends import requested_backend
from rocm_mla.distributed import (
    ParallelLayout,
    default_backend,
    destroy_parallel,
    init_parallel,
    launch,
)
from rocm_mla.engine.cache import CacheFullError, resolve_cache_dtype
from rocm_mla.engine.worker import EngineOptions, StageWorker, serve
from rocm_mla.models.kimi_k3 import KimiK3Config

#: Collective timeout of the workers (a whole engine lifetime can be long; faults are
#: reported by the launcher as soon as a rank raises or dies, not by this timeout).
WORKER_TIMEOUT_S = 24 * 3600.0

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, a torch dtype or None")
    return _DTYPES[dtype]


class LLM:
    """A Kimi-K3 / Kimi-Linear checkpoint served by this package's engine.

    Args:
        model: checkpoint directory (``config.json`` + safetensors).
        pp, tp, dcp: pipeline stages, tensor-parallel ranks per stage, and the decode
            context-parallel group size (a divisor of ``tp``); ``pp * tp`` processes.
        backend: MLA decode backend (``"torch"``, ``"triton"``, ``"aiter"``; None = auto).
        dtype: parameter/activation dtype (``"float32"``, ``"bfloat16"``, ...; None = the
            checkpoint's).
        block_size: tokens per physical KV-cache block (a multiple of ``dcp_interleave``).
        dcp_interleave: consecutive tokens per DCP rank before moving to the next.
        device: in-process device (None: cuda when available, else cpu); workers use the
            device their rank is given.
        num_blocks: physical KV blocks per MLA layer per rank; a request of ``L`` cached
            tokens takes ``cdiv(L, block_size * dcp)``.
        max_num_seqs: requests in flight at once (KDA state rows per layer).
        kv_cache_dtype: ``"auto"`` (model dtype) or ``"fp8"`` (where the backend reads it).
        seed: seed of the sampler (temperature > 0).
        launcher: ``"spawn"`` (this process starts the workers) or ``"torchrun"`` (this is
            one of ``pp * tp`` processes started by torchrun).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        pp: int = 1,
        tp: int = 1,
        dcp: int = 1,
        backend: str | None = None,
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
        dcp_interleave: int = 1,
        device: str | torch.device | None = None,
        num_blocks: int = 1024,
        max_num_seqs: int = 16,
        kv_cache_dtype: str | torch.dtype | None = "auto",
        seed: int = 0,
        launcher: str = "spawn",
    ) -> None:
        self._closed = True
        self.path = str(Path(model))
        self.layout = ParallelLayout(pp=pp, tp=tp, dcp=dcp)
        self.config = KimiK3Config.from_pretrained(self.path)
        if pp > self.config.num_hidden_layers:
            raise ValueError(
                f"pp: {pp} stages for {self.config.num_hidden_layers} layers leaves a stage empty"
            )
        self.config.check_tp(tp)
        for name, value in (
            ("block_size", block_size),
            ("dcp_interleave", dcp_interleave),
            ("num_blocks", num_blocks),
            ("max_num_seqs", max_num_seqs),
        ):
            _positive_int(name, value)
        if block_size % dcp_interleave:
            raise ValueError(
                f"block_size: {block_size} must be a multiple of dcp_interleave={dcp_interleave}"
            )
        if launcher not in ("spawn", "torchrun"):
            raise ValueError(f"launcher: expected 'spawn' or 'torchrun', got {launcher!r}")
        # Bad names are rejected here, not later inside a worker.
        resolve_cache_dtype(kv_cache_dtype, torch.float32)
        if backend is not None:
            requested_backend(backend)
        self.options = EngineOptions(
            pp=pp,
            tp=tp,
            dcp=dcp,
            dcp_interleave=dcp_interleave,
            backend=backend,
            dtype=_dtype(dtype),
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
        )
        self._local: StageWorker | None = None
        self._thread: threading.Thread | None = None
        self._launch_error: BaseException | None = None
        self.worker_pids: list[int] = []
        world = self.layout.world_size
        if launcher == "torchrun":
            state = init_parallel(pp, tp, dcp)
            self._local = StageWorker.load(self.path, self.options, state, state.device)
        elif world == 1:
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self._local = StageWorker.load(self.path, self.options, None, device)
        else:
            self._start_workers(world)
        self._launcher = launcher
        self._closed = False

    # ---- worker processes -----------------------------------------------------------------

    def _start_workers(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._replies = ctx.Queue()

        def run() -> None:
            try:
                launch(
                    serve,
                    world,
                    args=(self.path, self.options, self._inboxes, self._replies),
                    pp=self.layout.pp,
                    tp=self.layout.tp,
                    dcp=self.layout.dcp,
                    backend=default_backend(),
                    timeout_s=WORKER_TIMEOUT_S,
                )
            except BaseException as exc:  # handed to the caller's thread by _reply
                self._launch_error = exc

        self._thread = threading.Thread(target=run, name="rocm-mla-workers", daemon=True)
        self._thread.start()
        ready: dict[int, int] = {}
        while len(ready) < world:
            kind, rank, payload = self._reply_message()
            if kind != "ready":
                raise RuntimeError(f"LLM: expected 'ready' from the workers, got {kind!r}")
            ready[rank] = payload
        self.worker_pids = [ready[r] for r in range(world)]

    def _reply_message(self) -> tuple:
        """The next message from the workers; raises the launcher's error if they died."""
        while True:
            try:
                return self._replies.get(timeout=0.2)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive():
                    self._closed = True
                    error = self._launch_error or RuntimeError(
                        "LLM: the worker processes exited without a reply"
                    )
                    raise error from None

    def _call(self, op: str, *args):
        if self._closed:
            raise RuntimeError("LLM: this engine is closed (close() or a worker failure)")
        if self._local is not None:
            value = getattr(self._local, op)(*args)
            if self._launcher == "torchrun" and op == "score":
                value = self._local.comm.share_object(value)
            return value
        for inbox in self._inboxes:
            inbox.put((op, args))
        kind, _, payload = self._reply_message()
        if kind == "rejected":
            raise CacheFullError(payload)
        return pickle.loads(payload)

    def _inject_fault(self, rank: int) -> None:
        """Test hook: worker ``rank`` raises at the next call while its peers wait on it."""
        for inbox in self._inboxes:
            inbox.put(("fault", rank))

    # ---- public API -----------------------------------------------------------------------

    def _check_prompts(self, prompt_token_ids: list[list[int]]) -> list[list[int]]:
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids: expected a non-empty list of token-id lists")
        vocab = self.config.vocab_size
        prompts = []
        for i, prompt in enumerate(prompt_token_ids):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt_token_ids[{i}]: a prompt needs at least one token")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"prompt_token_ids[{i}]: token ids must lie in [0, {vocab}), got {bad[:5]}"
                )
            prompts.append(ids)
        return prompts

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_token_id: int | Collection[int] | None = None,
    ) -> list[list[int]]:
        """Continue each prompt; returns the new token ids per prompt.

        Args:
            prompt_token_ids: ``B`` prompts of any lengths.
            max_new_tokens: tokens to generate per prompt (fewer when EOS comes first).
            temperature: 0 for greedy; else softmax sampling at this temperature.
            eos_token_id: token id(s) that end a request (kept in its output); its cache
                blocks are freed at once while the others continue.

        Raises:
            CacheFullError: the batch does not fit the cache (says by how much and which
                argument to raise); nothing ran.
            WorkerError: a worker raised or died; names the rank. The engine is closed.
        """
        prompts = self._check_prompts(prompt_token_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens}")
        if not (isinstance(temperature, (int, float)) and temperature >= 0.0):
            raise ValueError(f"temperature: expected a float >= 0, got {temperature!r}")
        if eos_token_id is None:
            eos: tuple[int, ...] = ()
        elif isinstance(eos_token_id, int):
            eos = (eos_token_id,)
        else:
            eos = tuple(int(t) for t in eos_token_id)
        return self._call("generate", prompts, max_new_tokens, float(temperature), eos)

    def score(self, prompt_token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Prefill logits per prompt: ``[len(prompt), vocab]``, row ``i`` predicts token
        ``i + 1``."""
        return self._call("score", self._check_prompts(prompt_token_ids))

    def close(self) -> None:
        """Stop the workers (or leave the torchrun group); idempotent."""
        if self._thread is not None:
            if self._thread.is_alive():
                for inbox in self._inboxes:
                    inbox.put(("stop", None))
                self._thread.join(timeout=60.0)
            if self._thread.is_alive():
                raise RuntimeError(
                    f"LLM.close: workers {self.worker_pids} did not stop within 60 s"
                )
            self._thread = None
            for q in (*self._inboxes, self._replies):
                q.close()
                q.join_thread()
        elif self._local is not None and self._launcher == "torchrun" and not self._closed:
            destroy_parallel()
        self._local = None
        self._closed = True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self.close()
