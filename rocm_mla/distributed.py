"""Process groups for PP x TP with decode context parallelism (DCP) inside TP, and a launcher.

Layout (vLLM's): ``world = pp * tp``, TP innermost, so global rank
``= pp_rank * tp + tp_rank``. DCP groups are ``dcp`` consecutive ranks of one TP group
(``tp % dcp == 0``): DCP ranks hold different head shards of the same layers, and the DCP
decode gathers those heads (``rocm_mla.dcp``). Backend: gloo on CPU, nccl on GPU (on ROCm
torch's "nccl" is RCCL).

Single node, from Python (tests, the engine, the CLI)::

    results = launch(fn, 4, tp=4, dcp=2, args=(x,))   # fn(state, x) on 4 processes

Multi-node, with ``torchrun`` (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD_NODE:29500 my_script.py
    # my_script.py
    state = init_parallel(pp=2, tp=8, dcp=8)    # reads the torchrun environment
    ...
    destroy_parallel()

Faults never hang: ``launch`` reports the first rank that raised or died (naming it, with
its traceback) and terminates the others; collectives time out after ``timeout_s``.

Rendezvous: ``init_parallel`` on ``env://`` hosts rank 0's TCP store on ``$MASTER_ADDR``
only (``launch`` and ``LLM`` use 127.0.0.1), never on every interface; torchrun's own agent
store is left as torchrun made it.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "ParallelLayout",
    "ParallelState",
    "WorkerError",
    "backend_for",
    "default_backend",
    "destroy_parallel",
    "free_port",
    "init_parallel",
    "launch",
]

#: Seconds a collective (and a whole ``launch``) may take before it fails instead of hanging.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ParallelLayout:
    """``pp`` pipeline stages x ``tp`` tensor-parallel ranks; DCP groups of ``dcp`` in TP."""

    pp: int = 1
    tp: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dcp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel layout: {name} must be an int >= 1, got {value!r}")
        if self.tp % self.dcp:
            raise ValueError(
                f"parallel layout: dcp={self.dcp} must divide tp={self.tp}; DCP groups are "
                "subgroups of a TP group (set tp to a multiple of dcp)"
            )

    @classmethod
    def for_world(
        cls, world_size: int, pp: int = 1, tp: int | None = None, dcp: int = 1
    ) -> ParallelLayout:
        """The layout of ``world_size`` processes; ``tp`` defaults to ``world_size // pp``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if tp is None:
            if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world_size % pp:
                raise ValueError(
                    f"parallel layout: pp must be an int >= 1 that divides "
                    f"world_size={world_size}, got {pp!r}"
                )
            tp = world_size // pp
        layout = cls(pp=pp, tp=tp, dcp=dcp)
        if layout.world_size != world_size:
            raise ValueError(
                f"parallel layout: world_size={world_size} must equal pp * tp = "
                f"{pp} * {tp} = {layout.world_size}"
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dcp_rank(self, rank: int) -> int:
        return rank % self.dcp

    def tp_groups(self) -> list[list[int]]:
        """Global ranks of each TP group (one per stage)."""
        return [list(range(s * self.tp, (s + 1) * self.tp)) for s in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        """Global ranks of each pipeline (one per TP rank), in stage order."""
        return [list(range(t, self.world_size, self.tp)) for t in range(self.tp)]

    def dcp_groups(self) -> list[list[int]]:
        """Global ranks of each DCP group: ``dcp`` consecutive ranks of a TP group."""
        return [
            list(range(start, start + self.dcp)) for start in range(0, self.world_size, self.dcp)
        ]


@dataclass
class ParallelState:
    """This process's place in the layout and its process groups."""

    layout: ParallelLayout
    rank: int
    device: torch.device
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dcp_group: dist.ProcessGroup

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def dcp_rank(self) -> int:
        return self.layout.dcp_rank(self.rank)


def default_backend() -> str:
    """gloo on CPU, nccl (RCCL on ROCm) when torch sees a GPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def backend_for(nprocs: int, backend: str | None = None, *, who: str = "launch") -> str:
    """The process-group backend for ``nprocs`` local ranks, one GPU each on nccl.

    ``backend=None``: nccl when torch sees at least ``nprocs`` GPUs; with fewer (but some)
    GPUs the ranks run on CPU over gloo and one line on stderr says so. An explicit
    ``"nccl"`` with too few GPUs raises, naming the fix.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        if gpus and nprocs > gpus:
            print(
                f"rocm-mla {who}: {nprocs} ranks but torch sees {gpus} GPU(s): running them "
                "on CPU with gloo (use at most one rank per GPU to run on the GPUs)",
                file=sys.stderr,
            )
            return "gloo"
        return "nccl" if gpus else "gloo"
    if backend == "nccl" and nprocs > gpus:
        raise ValueError(
            f"{who}: {nprocs} processes on nccl need {nprocs} GPUs, torch sees {gpus}; use "
            "backend='gloo' (CPU) or at most one rank per GPU"
        )
    return backend


def pin_gloo_to_loopback(env: MutableMapping[str, str]) -> None:
    """Single node: gloo's pair sockets on the loopback interface, not the host's address."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _bound_store(addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A TCP store server listening on ``addr:port`` only (torch's own listens everywhere)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(max(128, world_size))
    except OSError as err:
        sock.close()
        raise OSError(
            f"rendezvous: cannot listen on MASTER_ADDR:MASTER_PORT = {addr}:{port} ({err})"
        ) from err
    # The store takes over the descriptor; detached so Python never closes it under it.
    return dist.TCPStore(
        addr,
        port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def _env_store(rank: int, world_size: int, timeout_s: float) -> dist.TCPStore | None:
    """The ``env://`` store, bound to ``$MASTER_ADDR``; None under torchrun's agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    addr = os.environ.get("MASTER_ADDR")
    port = _env_int("MASTER_PORT")
    if addr is None or port is None:
        raise ValueError(
            "init_parallel: env:// needs MASTER_ADDR and MASTER_PORT (the address and port "
            "rank 0 listens on); torchrun and rocm_mla.distributed.launch set them"
        )
    if rank == 0:
        return _bound_store(addr, port, world_size, timeout_s)
    return dist.TCPStore(addr, port, world_size, False, datetime.timedelta(seconds=timeout_s))


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_parallel(
    pp: int = 1,
    tp: int | None = None,
    dcp: int = 1,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: dist.Store | None = None,
) -> ParallelState:
    """Initialise ``torch.distributed`` and create the TP, PP and DCP groups.

    ``rank``/``world_size`` default to ``$RANK``/``$WORLD_SIZE`` (``torchrun``), and
    ``init_method`` to ``env://`` (``$MASTER_ADDR``/``$MASTER_PORT``; rank 0 listens on
    ``$MASTER_ADDR`` only, so name an address the other nodes reach). ``store``: an existing
    rendezvous store instead (``LLM`` hosts one on 127.0.0.1). On nccl the device is
    ``cuda:$LOCAL_RANK``. Every rank must call this with the same layout.
    """
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if rank is None or world_size is None:
        raise ValueError(
            "init_parallel: no rank/world_size given and RANK/WORLD_SIZE are not set; "
            "start the processes with torchrun, with rocm_mla.distributed.launch, or pass "
            "rank=, world_size= and init_method="
        )
    layout = ParallelLayout.for_world(world_size, pp, tp, dcp)
    if not 0 <= rank < world_size:
        raise ValueError(f"init_parallel: rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "init_parallel: torch.distributed is already initialised in this process; "
            "call destroy_parallel() first"
        )
    backend = default_backend() if backend is None else backend
    if backend == "nccl":
        local_rank = _env_int("LOCAL_RANK")
        local_rank = rank % max(1, torch.cuda.device_count()) if local_rank is None else local_rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None and init_method in (None, "env://"):
        store = _env_store(rank, world_size, timeout_s)
    if store is not None:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    # Every rank creates every group, in the same order (torch.distributed requires it).
    tp_group, _ = dist.new_subgroups_by_enumeration(layout.tp_groups())
    pp_group, _ = dist.new_subgroups_by_enumeration(layout.pp_groups())
    dcp_group, _ = dist.new_subgroups_by_enumeration(layout.dcp_groups())
    return ParallelState(layout, rank, device, tp_group, pp_group, dcp_group)


def destroy_parallel() -> None:
    """Tear down every process group of this process (a no-op if none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- launcher -----------------------------------------------------------------------------


class WorkerError(RuntimeError):
    """A launched rank raised, died or stalled; ``rank`` names it, the message carries its
    traceback (or the tail of its stderr) and ``summary`` says it in one line."""

    def __init__(self, rank: int, message: str, summary: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.summary = summary or _last_line(message)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGTERM this worker when the launcher dies, even by SIGKILL,
    so an interrupted launch leaves no orphan ranks blocked in a collective."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        os._exit(1)


def _worker(
    parent_pid: int,
    rank: int,
    nprocs: int,
    port: int,
    layout: ParallelLayout,
    backend: str,
    timeout_s: float,
    torch_threads: int | None,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    _die_with_parent(parent_pid)
    # A terminal's Ctrl-C reaches every process of its group: the launcher alone handles it
    # (and terminates the ranks), so N tracebacks are not printed over each other.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_gloo_to_loopback(os.environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        state = init_parallel(
            layout.pp, layout.tp, layout.dcp, backend=backend, timeout_s=timeout_s
        )
        value = fn(state, *args)
        # Pickled here, by value: tensors sent through the queue as such would travel as
        # shared-memory handles that die with this process.
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:  # a rank's failure of any kind is reported, then it exits
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        destroy_parallel()


def _stop(procs: Sequence[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 10.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: tuple = (),
    pp: int = 1,
    tp: int | None = None,
    dcp: int = 1,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    torch_threads: int | None = None,
) -> list[Any]:
    """Run ``fn(state, *args)`` on ``nprocs`` local processes; return its results by rank.

    Each process is spawned (fresh interpreter), joins a process group on a free local port
    and gets a ``ParallelState`` for the layout ``pp x tp`` (``tp`` defaults to
    ``nprocs // pp``) with DCP groups of ``dcp``. ``fn`` must be importable (module level)
    and its return value picklable.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None: nccl when torch sees a GPU per rank, else
            gloo on CPU (with a one-line notice when there are GPUs, just too few).
        torch_threads: torch intra-op threads per process; default on CPU
            ``max(1, cpu_count // nprocs)`` so the ranks do not oversubscribe the cores.
        timeout_s: wall-clock limit for the whole run and for each collective.

    Raises:
        WorkerError: a rank raised (its traceback is in the message) or died (its exit
            code); the other ranks are terminated first.
        TimeoutError: not every rank finished within ``timeout_s``; all are terminated.
    """
    layout = ParallelLayout.for_world(nprocs, pp, tp, dcp)
    backend = backend_for(nprocs, backend)
    if torch_threads is None and backend == "gloo":
        torch_threads = max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                os.getpid(),
                rank,
                nprocs,
                port,
                layout,
                backend,
                timeout_s,
                torch_threads,
                fn,
                args,
                results,
            ),
            name=f"rocm-mla-rank{rank}",
        )
        for rank in range(nprocs)
    ]
    try:
        for proc in procs:
            proc.start()
        outputs = _collect(procs, results, time.monotonic() + timeout_s, timeout_s)
    finally:
        _stop(procs)
        results.close()
        results.join_thread()
    return [outputs[r] for r in range(nprocs)]


def _drain(results: Any, outputs: dict, errors: dict, timeout: float) -> None:
    """Move every report that arrives within ``timeout`` into ``outputs`` or ``errors``."""
    try:
        status, rank, payload = results.get(timeout=timeout)
        while True:
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            status, rank, payload = results.get_nowait()
    except queue.Empty:
        return


def _collect(procs: Sequence[mp.Process], results: Any, deadline: float, timeout_s: float):
    """Every rank's result, or the exception that names the rank that failed first."""
    nprocs = len(procs)
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def silent_deaths() -> list[int]:
        return [
            r
            for r, p in enumerate(procs)
            if r not in outputs and r not in errors and not p.is_alive()
        ]

    while len(outputs) < nprocs and not errors:
        _drain(results, outputs, errors, timeout=0.2)
        if silent_deaths():
            # A report written just before the exit may still be in the pipe.
            _drain(results, outputs, errors, timeout=1.0)
            if silent_deaths():
                break
        if time.monotonic() > deadline and len(outputs) < nprocs and not errors:
            pending = [r for r in range(nprocs) if r not in outputs]
            raise TimeoutError(
                f"launch: ranks {pending} of {nprocs} did not finish within {timeout_s:.0f} s; "
                "all ranks were terminated"
            )
    if len(outputs) == nprocs:
        return outputs
    # Ranks blocked in a collective with a failed peer fail too, and may report first. A rank
    # that raised always reports before it exits, so one that died silently is the cause.
    dead = silent_deaths()
    if dead:
        rank = dead[0]
        cause = (
            f"rank {rank} of {nprocs} died with exit code {procs[rank].exitcode} without "
            "reporting (killed or crashed)"
        )
    else:
        rank = next(iter(errors))
        cause = f"rank {rank} of {nprocs} failed. Its error:\n{errors[rank]}"
    others = sorted(set(errors) - {rank})
    also = f"; ranks {others} also failed, after it" if others else ""
    raise WorkerError(rank, f"{cause}\nThe other ranks were terminated{also}.")
