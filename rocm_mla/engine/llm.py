"""``rocm_mla.LLM``: generate and score with a Kimi-K3 / Kimi-Linear checkpoint over PP x TP x DCP.

``pp * tp == 1`` runs in this process. Otherwise ``LLM`` starts ``pp * tp`` long-lived
worker processes as ``python -m rocm_mla.engine.worker`` (fresh interpreters that never
import the caller's ``__main__``: scripts without a main guard, stdin, the REPL and notebooks
all work). They join a process group through a rendezvous store this process serves on
127.0.0.1 to holders of a one-time token only (``rocm_mla.distributed.StoreServer``), and
take each call over a loopback connection authenticated by the same token; once every
worker joined, this process listens on no socket. Workers are never re-spawned per call.

Faults end in bounded time: a worker that raises or dies makes the call raise ``WorkerError``
naming the rank (its traceback, or the tail of its stderr); a rank that stops sending
heartbeats, or a call that exceeds ``call_timeout_s``, does too. Ctrl-C (SIGINT to this
process) stops the workers and raises one ``KeyboardInterrupt``. After any of these the
engine is closed. An engine that is never closed stops its workers when it is garbage
collected or the interpreter exits.

Devices: with ``device=None`` the workers get one GPU each when torch sees at least
``pp * tp`` GPUs; with fewer they run on CPU over gloo, after a one-line notice on stderr.
``device="cuda"`` insists on the GPUs (and is refused when there are too few),
``device="cpu"`` runs on CPU everywhere.

Multi-node, or to own the processes yourself: start every rank with ``torchrun`` and build
the engine with ``launcher="torchrun"`` in each; every rank then calls ``generate``/``score``
with the same arguments and gets the same result::

    torchrun --nproc-per-node 4 -m rocm_mla.cli generate --torchrun --model DIR \\
        --pp 2 --tp 2 --dcp 2 --prompt-ids 1,2,3

"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from rocm_mla.backends import ENV_VAR, backend_class, requested_backend
from rocm_mla.dcp import check_block_size
from rocm_mla.distributed import (
    TOKEN_BYTES,
    ParallelLayout,
    StoreServer,
    TokenListener,
    WorkerError,
    backend_for,
    destroy_parallel,
    init_parallel,
    pin_to_loopback,
)
from rocm_mla.engine.cache import CacheFullError, resolve_cache_dtype
from rocm_mla.engine.prompts import check_prompts, token_id
from rocm_mla.engine.worker import (
    CONTROL_PURPOSE,
    HEARTBEAT_S,
    EngineOptions,
    StageWorker,
    WorkerSpec,
)
from rocm_mla.models.kimi_k3 import KimiK3Config
from rocm_mla.models.kimi_k3.limits import check_memory
from rocm_mla.platform import resolve_device

#: Collective timeout inside the workers (an engine's lifetime can be long; faults are
#: caught by this process through deaths, errors, heartbeats and the call timeout).
WORKER_TIMEOUT_S = 24 * 3600.0
#: Default limit of one generate/score call, in seconds.
DEFAULT_CALL_TIMEOUT_S = 3600.0
#: Limit of the workers' start (import, rendezvous, loading the shards), in seconds; a
#: worker that dies, or stops sending heartbeats once connected, fails the start sooner.
START_TIMEOUT_S = 3600.0
#: A busy rank silent this long is reported as stalled (stopped, or stuck holding the GIL);
#: longer while loading, where one huge tensor read may hold the GIL for a while.
HEARTBEAT_TIMEOUT_S = 60.0
START_HEARTBEAT_TIMEOUT_S = 300.0
#: Seconds idle workers get to exit on "stop" before they are terminated, then killed.
STOP_GRACE_S = 5.0
#: Seconds between the progress lines of ``generate(show_progress=True)``.
PROGRESS_PRINT_S = 2.0

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(
        f"dtype: expected one of {sorted(_DTYPES)} (or that torch dtype) or None, got {dtype!r}"
    )


def _seed(seed: object) -> int:
    # torch.Generator.manual_seed takes any 64-bit value; anything else is a typo.
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
    return seed


def _check_backend(backend: object) -> None:
    """The MLA backend asked for (``backend=``, else ``$ROCM_MLA_BACKEND``) exists and can run
    on this machine; refused here, not at the first decode step after loading."""
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"backend: expected a backend name or None, got {backend!r}")
    try:
        name = requested_backend(backend)
    except ValueError as err:
        raise ValueError(f"backend: {err}" if backend is not None else str(err)) from None
    if name == "auto":
        return
    reason = backend_class(name).unavailable_reason()
    if reason is not None:
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(
            f"{source}: MLA backend {name!r} cannot run on this machine: {reason}; choose "
            "another (`rocm-mla info` lists them) or auto"
        )


def local_device(device: str | torch.device | None) -> torch.device:
    """The device of a single-process engine: ``device``, or the current GPU when torch sees
    one, else the CPU; ``"cuda"`` resolved to ``cuda:<current>`` (``platform.resolve_device``)
    so the caches, step tensors and plans all name one device. Raises ``ValueError`` naming
    ``device`` for a GPU torch cannot see."""
    if device is None:
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or None, got {device!r}")
    if dev.type == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= gpus:
            build = "" if torch.version.cuda or torch.version.hip else " (a CPU-only torch build)"
            raise ValueError(
                f"device: {device!r} but torch {torch.__version__}{build} sees {gpus} GPU(s); "
                "use device='cpu', or None to take a GPU only when there is one"
            )
    return resolve_device(dev)


def placement(world: int, device: str | torch.device | None) -> tuple[str, str]:
    """``(process-group backend, device type)`` of ``world`` worker processes.

    See the module docstring; raises ``ValueError`` naming ``device`` and the fix.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        backend = backend_for(world, who="LLM")
        return backend, "cuda" if backend == "nccl" else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu', 'cuda' or None, got {device!r}") from None
    if dev.type == "cpu":
        return "gloo", "cpu"
    if dev.type != "cuda":
        raise ValueError(f"device: expected 'cpu', 'cuda' or None, got {device!r}")
    if dev.index is not None:
        raise ValueError(
            f"device: {device!r} names one GPU, but pp * tp = {world} worker processes take "
            "one GPU each (rank r on GPU r): pass 'cuda', or choose the GPUs with "
            "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES"
        )
    if world > gpus:
        raise ValueError(
            f"device: 'cuda' needs one GPU per rank, pp * tp = {world} ranks but torch sees "
            f"{gpus} GPU(s); use fewer ranks, or device='cpu' (gloo)"
        )
    return "nccl", "cuda"


def check_generate_args(
    config: KimiK3Config,
    prompt_token_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | Collection[int] | None = None,
) -> tuple[list[list[int]], tuple[int, ...]]:
    """``LLM.generate``'s checks, usable before an engine exists: ``(prompts, eos ids)``."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens}")
    prompts = check_prompts(config, prompt_token_ids, max_new_tokens)
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and 0.0 <= temperature < float("inf")
    ):
        raise ValueError(f"temperature: expected a finite float >= 0, got {temperature!r}")
    if eos_token_id is None:
        return prompts, ()
    if isinstance(eos_token_id, (list, tuple, set, frozenset)):
        return prompts, tuple(token_id(t, "eos_token_id") for t in eos_token_id)
    return prompts, (token_id(eos_token_id, "eos_token_id"),)


@dataclasses.dataclass(frozen=True)
class _EnginePlan:
    """What ``LLM`` will do, decided from its arguments before any of it is done."""

    path: str
    layout: ParallelLayout
    config: KimiK3Config
    options: EngineOptions
    #: Single process: its device. Spawned workers: their process-group backend.
    device: torch.device | None
    group_backend: str | None


def _plan(
    model: str | os.PathLike,
    *,
    pp: int = 1,
    tp: int = 1,
    dcp: int = 1,
    backend: str | None = None,
    dtype: str | torch.dtype | None = None,
    block_size: int = EngineOptions.block_size,
    dcp_interleave: int = EngineOptions.dcp_interleave,
    device: str | torch.device | None = None,
    num_blocks: int = EngineOptions.num_blocks,
    max_num_seqs: int = EngineOptions.max_num_seqs,
    kv_cache_dtype: str | torch.dtype | None = "auto",
    seed: int = EngineOptions.seed,
    enforce_eager: bool = False,
    launcher: str = "spawn",
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
) -> _EnginePlan:
    """Every check of ``LLM``'s arguments, its config and its memory, in that order; each
    failure a ``ValueError`` naming the argument (or config file and key)."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model: expected a checkpoint directory path, got {model!r}")
    path = str(Path(model))
    if not Path(path).is_dir():
        raise ValueError(f"model: {path} is not a directory")
    for name, value in (
        ("pp", pp),
        ("tp", tp),
        ("dcp", dcp),
        ("block_size", block_size),
        ("dcp_interleave", dcp_interleave),
        ("num_blocks", num_blocks),
        ("max_num_seqs", max_num_seqs),
    ):
        _positive_int(name, value)
    layout = ParallelLayout(pp=pp, tp=tp, dcp=dcp)
    check_block_size(block_size, dcp_interleave)
    if launcher not in ("spawn", "torchrun"):
        raise ValueError(f"launcher: expected 'spawn' or 'torchrun', got {launcher!r}")
    if isinstance(call_timeout_s, bool) or not (
        isinstance(call_timeout_s, (int, float)) and call_timeout_s > 0
    ):
        raise ValueError(f"call_timeout_s: expected seconds > 0, got {call_timeout_s!r}")
    options = EngineOptions(
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
        seed=_seed(seed),
        enforce_eager=_bool("enforce_eager", enforce_eager),
    )
    resolve_cache_dtype(kv_cache_dtype, torch.float32)
    _check_backend(backend)
    world = layout.world_size
    run_device: torch.device | None = None
    group_backend: str | None = None
    if launcher == "spawn" and world == 1:
        run_device = local_device(device)
    elif launcher == "spawn":
        group_backend, kind = placement(world, device)
    config = KimiK3Config.from_pretrained(path)
    if pp > config.num_hidden_layers:
        raise ValueError(
            f"pp: {pp} stages for {config.num_hidden_layers} layers leaves a stage empty"
        )
    config.check_tp(tp)
    if run_device is not None:
        _check_memory(config, options, run_device, 1)
    elif group_backend is not None:
        _check_memory(config, options, kind, world)
    return _EnginePlan(path, layout, config, options, run_device, group_backend)


def _check_memory(
    config: KimiK3Config, options: EngineOptions, device: str | torch.device, ranks: int
) -> None:
    """Weights and caches of ``ranks`` ranks against this host's (or a GPU's) free memory,
    before anything is allocated."""
    itemsize = options.dtype.itemsize if options.dtype is not None else None
    kv_dtype = resolve_cache_dtype(options.kv_cache_dtype, options.dtype or torch.int8)
    check_memory(
        config,
        device=device,
        pp=options.pp,
        tp=options.tp,
        ranks_here=ranks,
        param_itemsize=itemsize,
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        kv_itemsize=kv_dtype.itemsize,
        max_num_seqs=options.max_num_seqs,
    )


class _ProgressLine:
    """Throttled ``generate`` progress on stderr: nothing for calls shorter than
    ``PROGRESS_PRINT_S``, then one line per ``PROGRESS_PRINT_S``."""

    def __init__(self, num_prompts: int) -> None:
        self.num_prompts = num_prompts
        self.start = self.last = time.monotonic()

    def __call__(self, step: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_PRINT_S:
            return
        self.last = now
        elapsed = now - self.start
        print(
            f"rocm-mla: {step}/{total} new tokens for {self.num_prompts} prompt(s) after "
            f"{elapsed:.0f} s ({step / elapsed:.1f} steps/s)",
            file=sys.stderr,
            flush=True,
        )


def _stderr_tail(log, limit: int = 2000) -> str:
    log.flush()
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(0, size - limit))
    text = log.read().decode(errors="replace").strip()
    return text or "(nothing on its stderr)"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerGroup:
    """The ``pp * tp`` worker processes of one ``LLM`` and the connections to them.

    Holds no reference to the ``LLM``, so a finalizer can stop it when the engine is
    collected or the interpreter exits.
    """

    def __init__(
        self, path: str, options: EngineOptions, backend: str, call_timeout_s: float
    ) -> None:
        self.world = options.pp * options.tp
        self.sampler = (options.pp - 1) * options.tp
        self.call_timeout_s = call_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.conns: dict[int, Connection] = {}
        self.pids: list[int] = []
        self._call_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._stopped = False
        self._ready = False
        self._handles_closed = False
        self._store: StoreServer | None = None
        token = secrets.token_bytes(TOKEN_BYTES)
        control = TokenListener(token, self.world, CONTROL_PURPOSE)
        try:
            self._start(path, options, backend, control, token)
        except BaseException:
            self.stop()
            raise
        finally:
            control.close()

    # ---- start --------------------------------------------------------------------------

    def _start(
        self,
        path: str,
        options: EngineOptions,
        backend: str,
        control: TokenListener,
        token: bytes,
    ) -> None:
        # The rendezvous keys, served here to token holders only (see StoreServer).
        self._store = StoreServer(token, self.world)
        env = dict(os.environ)
        # The workers import this very package, wherever the caller found it.
        root = str(Path(__file__).resolve().parents[2])  # the folder holding rocm_mla/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        pin_to_loopback(env)
        threads = None
        if backend == "gloo":
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: no GPU contexts behind the user's back
            threads = max(1, (os.cpu_count() or 1) // self.world)
        for rank in range(self.world):
            spec = WorkerSpec(
                rank=rank,
                path=path,
                options=options,
                backend=backend,
                control_port=control.port,
                store_port=self._store.port,
                token=token,
                parent_pid=os.getpid(),
                torch_threads=threads,
                collective_timeout_s=WORKER_TIMEOUT_S,
            )
            # Closed in _close_handles: it outlives this function, read for error reports.
            log = tempfile.TemporaryFile(prefix=f"rocm-mla-rank{rank}-")  # noqa: SIM115
            self.logs.append(log)
            env["LOCAL_RANK"] = str(rank)
            proc = subprocess.Popen(
                [sys.executable, "-m", "rocm_mla.engine.worker"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                env=env,
                # Its own session: a terminal's Ctrl-C reaches this process only, which
                # then stops the workers itself.
                start_new_session=True,
            )
            self.procs.append(proc)
            try:
                proc.stdin.write(pickle.dumps(spec))
                proc.stdin.close()
            except OSError:
                pass  # it died at once; _accept reports how
        self.pids = [proc.pid for proc in self.procs]
        deadline = time.monotonic() + START_TIMEOUT_S
        self._accept(control, deadline)
        self._gather("ready", deadline, heartbeat_timeout_s=START_HEARTBEAT_TIMEOUT_S)
        self._ready = True

    def _accept(self, control: TokenListener, deadline: float) -> None:
        while len(self.conns) < self.world:
            for rank, proc in enumerate(self.procs):
                if rank not in self.conns and proc.poll() is not None:
                    raise self._died(rank, "while starting")
            if time.monotonic() > deadline:
                rank = min(set(range(self.world)) - set(self.conns))
                raise WorkerError(
                    rank,
                    f"rank {rank} of {self.world} did not connect within "
                    f"{START_TIMEOUT_S:.0f} s; its output ends with:\n"
                    f"{_stderr_tail(self.logs[rank])}",
                )
            # Strangers' connections are read side by side with the workers' and dropped
            # unread; they delay no worker (TokenListener).
            wait(control.waitables(), timeout=0.2)
            self.conns.update(control.step())

    def _died(self, rank: int, when: str) -> WorkerError:
        proc = self.procs[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
        how = _exit_text(proc.poll())
        return WorkerError(
            rank,
            f"rank {rank} of {self.world} (pid {proc.pid}) {how} {when}, without "
            f"reporting an error; its output ends with:\n{_stderr_tail(self.logs[rank])}",
            summary=f"rank {rank} of {self.world} {how} {when}",
        )

    # ---- calls --------------------------------------------------------------------------

    def _gather(
        self,
        kind: str,
        deadline: float,
        progress: Callable | None = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> dict:
        """Every rank's next ``kind`` message; ``WorkerError`` for the first rank that
        raised, died or stalled."""
        got: dict[int, tuple] = {}
        errors: dict[int, tuple[float, str]] = {}
        dead: list[int] = []
        beat = dict.fromkeys(range(self.world), time.monotonic())
        rank_of = {id(conn): rank for rank, conn in self.conns.items()}
        while len(got) < self.world:
            if self._stopped:
                raise RuntimeError("LLM: the engine was closed while this call was running")
            open_conns = [c for r, c in self.conns.items() if r not in dead]
            for conn in wait(open_conns, timeout=0.2):
                rank = rank_of[id(conn)]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    dead.append(rank)
                    continue
                beat[rank] = time.monotonic()
                if message[0] == "error":
                    errors[rank] = (message[1], message[2])
                elif message[0] == "progress":
                    if progress is not None:
                        progress(message[1], message[2])
                elif message[0] == kind:
                    got[rank] = message
            if self._stopped:  # close() from another thread: the deaths are its doing
                raise RuntimeError("LLM: the engine was closed while this call was running")
            if errors or dead:
                raise self._fault(errors, dead, "while starting" if kind == "ready" else "")
            now = time.monotonic()
            silent = {r: now - beat[r] for r in range(self.world) if r not in got}
            stalled = [r for r, age in silent.items() if age > heartbeat_timeout_s]
            if stalled or now > deadline:
                rank = max(silent, key=silent.get)
                age = silent[rank]
                why = (
                    f"sent no heartbeat for {age:.0f} s (stopped, e.g. by SIGSTOP, or stuck "
                    "without releasing the GIL)"
                    if age > 3 * HEARTBEAT_S
                    else f"did not finish within call_timeout_s={self.call_timeout_s:g} s "
                    "(raise it for longer calls)"
                )
                message = f"rank {rank} of {self.world} (pid {self.pids[rank]}) {why}"
                raise WorkerError(rank, message + "; all workers were stopped", message)
        return got

    def _fault(
        self, errors: dict[int, tuple[float, str]], dead: list[int], when: str
    ) -> WorkerError:
        # The rank that failed first is the cause; its peers fail after it (a broken
        # collective), so let their reports arrive before choosing.
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            live = [c for r, c in self.conns.items() if r not in dead]
            for conn in wait(live, timeout=0.1):
                rank = next(r for r, c in self.conns.items() if c is conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    dead.append(rank)
                    continue
                if message[0] == "error":
                    errors[rank] = (message[1], message[2])
        silent = [r for r in dead if r not in errors]
        if silent:
            # A rank that raises always reports first, so one that died silently is the cause.
            return self._died(silent[0], when or "during a call")
        rank = min(errors, key=lambda r: errors[r][0])
        trace = errors[rank][1].rstrip()
        others = sorted(set(errors) - {rank})
        also = f"; ranks {others} also failed, after it" if others else ""
        return WorkerError(
            rank,
            f"rank {rank} of {self.world} failed. Its error:\n{trace}\n"
            f"The other ranks were stopped{also}.",
            summary=f"rank {rank} of {self.world} failed: {trace.splitlines()[-1]}",
        )

    def call(self, op: str, args: tuple, progress: Callable | None = None):
        """Run ``op(*args)`` on every rank; the sampler rank's value."""
        with self._call_lock:
            if self._stopped:
                raise RuntimeError("LLM: this engine is closed (close() or a worker failure)")
            try:
                for conn in self.conns.values():
                    # A dead worker cannot take it: _gather names that rank.
                    with contextlib.suppress(OSError):
                        conn.send((op, args))
                replies = self._gather("done", time.monotonic() + self.call_timeout_s, progress)
            except BaseException:
                self.stop()
                raise
            finally:
                if self._stopped:
                    self._close_handles()
        outcome = replies[self.sampler][1]
        if outcome[0] == "rejected":
            raise CacheFullError(*outcome[1:])
        return pickle.loads(outcome[1])

    def send_all(self, message: tuple) -> None:
        for conn in self.conns.values():
            conn.send(message)

    # ---- stop ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every worker: "stop" when idle, then SIGTERM, then SIGKILL; bounded, never
        raises, idempotent."""
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
        idle = self._call_lock.acquire(blocking=False)
        try:
            if idle and self._ready:  # loading workers read no commands: no grace then
                for conn in self.conns.values():
                    with contextlib.suppress(OSError):
                        conn.send(("stop", None))
                self._wait_exit(STOP_GRACE_S)
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
            self._wait_exit(3.0)
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()  # also ends a SIGSTOPped process
            self._wait_exit(5.0)
        finally:
            if idle:
                self._close_handles()
                self._call_lock.release()

    def _wait_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _close_handles(self) -> None:
        if self._handles_closed:
            return
        self._handles_closed = True
        for conn in self.conns.values():
            conn.close()
        for log in self.logs:
            log.close()
        if self._store is not None:
            self._store.close()


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
        device: ``None``, ``"cpu"`` or ``"cuda"`` (one process: also ``"cuda:1"``). None:
            cuda when torch sees a GPU for every rank, else cpu (multi-process layouts then
            run on CPU over gloo, with a one-line notice). ``"cuda"`` with too few GPUs is
            refused.
        num_blocks: physical KV blocks per MLA layer per rank; a request of ``L`` cached
            tokens takes ``cdiv(L, block_size * dcp)``.
        max_num_seqs: requests in flight at once (KDA state rows per layer).
        kv_cache_dtype: ``"auto"`` (model dtype) or ``"fp8"`` (where the backend reads it).
        seed: seed of the sampler (temperature > 0).
        enforce_eager: never capture decode steps in CUDA/HIP graphs. By default a
            single-process engine on a GPU captures each padded batch size once and replays
            it (``rocm_mla.engine.graphs``); multi-process layouts and CPUs run eagerly.
        launcher: ``"spawn"`` (this process starts the workers) or ``"torchrun"`` (this is
            one of ``pp * tp`` processes started by torchrun).
        call_timeout_s: limit of one ``generate``/``score`` call; a rank that exceeds it
            (or sends no heartbeat for ``HEARTBEAT_TIMEOUT_S``) is named in a
            ``WorkerError``.
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
        block_size: int = EngineOptions.block_size,
        dcp_interleave: int = EngineOptions.dcp_interleave,
        device: str | torch.device | None = None,
        num_blocks: int = EngineOptions.num_blocks,
        max_num_seqs: int = EngineOptions.max_num_seqs,
        kv_cache_dtype: str | torch.dtype | None = "auto",
        seed: int = EngineOptions.seed,
        enforce_eager: bool = False,
        launcher: str = "spawn",
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self._closed = True
        self._group: WorkerGroup | None = None
        self._local: StageWorker | None = None
        plan = _plan(
            model, pp=pp, tp=tp, dcp=dcp, backend=backend, dtype=dtype, block_size=block_size,
            dcp_interleave=dcp_interleave, device=device, num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype, seed=seed,
            enforce_eager=enforce_eager, launcher=launcher, call_timeout_s=call_timeout_s,
        )  # fmt: skip
        self.path, self.layout, self.config = plan.path, plan.layout, plan.config
        self.options = plan.options
        self.worker_pids: list[int] = []
        self._launcher = launcher
        if launcher == "torchrun":
            state = init_parallel(pp, tp, dcp)
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            _check_memory(plan.config, plan.options, state.device.type, ranks_here)
            self._local = StageWorker.load(self.path, self.options, state, state.device)
        elif plan.group_backend is None:
            self._local = StageWorker.load(self.path, self.options, None, plan.device)
        else:
            self._group = WorkerGroup(
                self.path, self.options, plan.group_backend, float(call_timeout_s)
            )
            self.worker_pids = list(self._group.pids)
            # Stops the workers when this engine is collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, self._group.stop)
        self._closed = False

    @staticmethod
    def check(model: str | os.PathLike, **kwargs: object) -> None:
        """Raise the ``ValueError`` that ``LLM(model, **kwargs)`` would raise for its arguments,
        its config or its memory, without loading weights or starting a process."""
        _plan(model, **kwargs)

    # ---- calls ----------------------------------------------------------------------------

    def _call(self, op: str, *args, progress: Callable[[int, int], None] | None = None):
        if self._closed:
            raise RuntimeError("LLM: this engine is closed (close() or a worker failure)")
        if self._group is not None:
            try:
                return self._group.call(op, args, progress)
            except (WorkerError, KeyboardInterrupt, RuntimeError):
                if self._group._stopped:
                    self._closed = True
                raise
        if op == "generate":
            return self._local.generate(*args, progress=progress)
        value = self._local.score(*args)
        if self._launcher == "torchrun":
            value = self._local.comm.share_object(value)
        return value

    def _inject_fault(self, rank: int) -> None:
        """Test hook: worker ``rank`` raises at the next call while its peers wait on it."""
        self._group.send_all(("fault", rank))

    # ---- public API -----------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_token_id: int | Collection[int] | None = None,
        show_progress: bool = False,
    ) -> list[list[int]]:
        """Continue each prompt; returns the new token ids per prompt.

        Args:
            prompt_token_ids: ``B`` prompts of any lengths.
            max_new_tokens: tokens to generate per prompt (fewer when EOS comes first).
            temperature: 0 for greedy; else softmax sampling at this temperature.
            eos_token_id: token id(s) that end a request (kept in its output); its cache
                blocks are freed at once while the others continue.
            show_progress: print a progress line on stderr every few seconds (nothing for
                calls that end sooner).

        Raises:
            CacheFullError: the batch does not fit the cache (says by how much and which
                argument to raise); nothing ran.
            WorkerError: a worker raised or died; names the rank. The engine is closed.
        """
        prompts, eos = check_generate_args(
            self.config, prompt_token_ids, max_new_tokens, temperature, eos_token_id
        )
        progress = _ProgressLine(len(prompts)) if show_progress else None
        return self._call(
            "generate", prompts, max_new_tokens, float(temperature), eos, progress=progress
        )

    def score(self, prompt_token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Prefill logits per prompt, on the CPU: ``[len(prompt), vocab]``, row ``i`` predicts
        token ``i + 1``."""
        return self._call("score", check_prompts(self.config, prompt_token_ids))

    def close(self) -> None:
        """Stop the workers (or leave the torchrun group); idempotent, bounded (idle workers
        get a few seconds to exit, then are terminated, then killed), and safe while another
        thread's call is running (that call then raises)."""
        if self._group is not None:
            self._finalizer()
        elif self._local is not None and self._launcher == "torchrun" and not self._closed:
            destroy_parallel()
        self._local = None
        self._closed = True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
