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

Rendezvous: single-node groups (``launch``, ``LLM``) meet through ``StoreServer``, a store
the launching process serves on 127.0.0.1 to clients that presented a one-time token only,
and that stops listening once every rank joined; their gloo and NCCL/RCCL sockets are pinned
to loopback (``pin_to_loopback``). ``init_parallel`` on ``env://`` (torchrun, multi-node)
hosts rank 0's TCP store on ``$MASTER_ADDR`` only, never on every interface; torchrun's own
agent store is left as torchrun made it.
"""

from __future__ import annotations

import ctypes
import datetime
import hmac
import os
import pickle
import queue
import secrets
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "ParallelLayout",
    "ParallelState",
    "StoreServer",
    "TokenListener",
    "TokenStore",
    "WorkerError",
    "backend_for",
    "connect_store",
    "default_backend",
    "destroy_parallel",
    "free_port",
    "init_parallel",
    "launch",
    "pin_to_loopback",
    "token_connect",
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


def pin_to_loopback(env: MutableMapping[str, str]) -> None:
    """Single node: gloo's pair sockets and NCCL's (RCCL's) bootstrap and socket transport on
    the loopback interface, not on the host's address; a value the user set is kept."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")


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


# ---- private single-node rendezvous -------------------------------------------------------
#
# torch's TCPStore serves every key to whoever connects (it has no authentication), so a
# local stranger could list, read, overwrite and delete the rendezvous keys. Single-node
# groups (``launch``, ``LLM``) use ``StoreServer`` instead: a thread of the launching process
# that serves the keys only on connections that first presented a one-time token, and that
# stops listening as soon as every rank has joined.

#: Bytes of the one-time rendezvous token (``secrets.token_bytes``).
TOKEN_BYTES = 32
#: Seconds a new connection gets to present its token before it is dropped. Connections are
#: read side by side, so a silent one delays no other; this only bounds what it holds.
HANDSHAKE_TIMEOUT_S = 10.0
#: Connections still presenting their token, at most; past it the oldest is dropped (a real
#: rank sends its token the moment it connects, so the oldest is the likeliest stray).
MAX_PENDING_CONNECTIONS = 64
#: Purpose bytes: which listener a client meant (an engine has a control and a store one).
STORE_PURPOSE = b"S"

_RANK = struct.Struct("!I")


class TokenListener:
    """A socket listening on 127.0.0.1 whose connections count once they present the token.

    A client's first bytes are ``token + purpose + rank`` (``token_connect``). ``step()``
    never blocks: it accepts what is waiting, reads what pending connections sent, and
    returns ``(rank, Connection)`` for each that presented the token and purpose with a new
    rank in ``[0, world)``. Every other connection is closed after at most those few bytes:
    nothing a stranger sends is unpickled, and a silent one is dropped after
    ``HANDSHAKE_TIMEOUT_S`` without holding up the rest.
    """

    def __init__(self, token: bytes, world: int, purpose: bytes) -> None:
        if len(token) != TOKEN_BYTES or len(purpose) != 1:
            raise ValueError(
                f"TokenListener: expected a {TOKEN_BYTES}-byte token and a 1-byte purpose, "
                f"got {len(token)} and {len(purpose)} bytes"
            )
        self._sock: socket.socket | None = socket.create_server(
            ("127.0.0.1", 0), backlog=max(128, world)
        )
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._expected = token + purpose
        self._hello_size = len(self._expected) + _RANK.size
        self._world = world
        self._joined: set[int] = set()
        # Insertion-ordered: the first entry is the oldest pending connection.
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}

    def waitables(self) -> list[socket.socket]:
        """What to ``multiprocessing.connection.wait`` on before the next ``step``."""
        return [] if self._sock is None else [self._sock, *self._pending]

    def step(self) -> list[tuple[int, Connection]]:
        if self._sock is None:
            return []
        now = time.monotonic()
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            sock.setblocking(False)
            self._pending[sock] = (now + HANDSHAKE_TIMEOUT_S, bytearray())
            if len(self._pending) > MAX_PENDING_CONNECTIONS:
                self._drop(next(iter(self._pending)))
        joined = []
        for sock, (deadline, hello) in list(self._pending.items()):
            try:
                chunk = sock.recv(self._hello_size - len(hello))
            except (BlockingIOError, InterruptedError):
                if now > deadline:
                    self._drop(sock)
                continue
            except OSError:
                self._drop(sock)
                continue
            if not chunk:
                self._drop(sock)
                continue
            hello += chunk
            if len(hello) < self._hello_size:
                continue
            del self._pending[sock]
            rank = self._rank_of(bytes(hello))
            if rank is None:
                sock.close()
                continue
            self._joined.add(rank)
            sock.setblocking(True)
            joined.append((rank, Connection(sock.detach())))
        return joined

    def _rank_of(self, hello: bytes) -> int | None:
        head = len(self._expected)
        if not hmac.compare_digest(hello[:head], self._expected):
            return None
        (rank,) = _RANK.unpack(hello[head:])
        if rank >= self._world or rank in self._joined:
            return None
        return rank

    def _drop(self, sock: socket.socket) -> None:
        del self._pending[sock]
        sock.close()

    def close(self) -> None:
        """Stop listening and drop every pending connection (idempotent)."""
        for sock in list(self._pending):
            self._drop(sock)
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def token_connect(
    port: int, token: bytes, purpose: bytes, rank: int, timeout_s: float = 60.0
) -> Connection:
    """A connection to the ``TokenListener`` on 127.0.0.1:``port``, token presented."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.sendall(token + purpose + _RANK.pack(rank))
    sock.settimeout(None)
    return Connection(sock.detach())


class StoreServer:
    """The rendezvous keys of ``world`` local ranks, served by a thread of this process.

    Only clients that presented ``token`` (``connect_store``) are served; once ``world`` of
    them joined the listening socket is closed, so nothing else can even connect. The keys
    live here as long as the server does (NCCL creates its communicators, through the store,
    at a group's first collective). Semantics follow torch's TCPStore: ``add`` keeps a
    decimal count, ``get``/``wait`` block until the keys exist or their timeout passes.
    """

    def __init__(self, token: bytes, world: int) -> None:
        self._listener: TokenListener | None = TokenListener(token, world, STORE_PURPOSE)
        self.port = self._listener.port
        self._world = world
        self._conns: list[Connection] = []
        self._data: dict[str, bytes] = {}
        self._joined = 0
        # (connection, keys, deadline, "get" | "multi_get" | "wait") of each blocked request.
        self._blocked: list[tuple[Connection, list[str], float, str]] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rocm-mla-store", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def close(self) -> None:
        """Stop serving and close every connection (idempotent, bounded)."""
        self._closing.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _serve(self) -> None:
        try:
            while not self._closing.is_set():
                waitables = [*self._conns]
                if self._listener is not None:
                    waitables += self._listener.waitables()
                ready = wait(waitables, timeout=0.1)
                if self._listener is not None:
                    joined = [conn for _, conn in self._listener.step()]
                    self._conns += joined
                    self._joined += len(joined)
                    if self._joined == self._world:
                        self._listener.close()
                        self._listener = None
                for conn in ready:
                    if isinstance(conn, Connection) and conn in self._conns:
                        self._serve_one(conn)
                self._expire()
        finally:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for conn in self._conns:
                conn.close()
            self._conns = []

    def _serve_one(self, conn: Connection) -> None:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError, ValueError, TypeError):
            self._forget(conn)
            return
        if op in ("get", "multi_get", "wait"):
            keys = [args[0]] if op == "get" else list(args[0])
            self._blocked.append((conn, keys, time.monotonic() + args[1], op))
            self._release()
            return
        try:
            reply = self._apply(op, args)
        except (TypeError, ValueError, IndexError) as err:
            # A malformed request fails that request, never the thread serving every rank.
            reply = ("error", f"rendezvous store: bad {op!r} request ({err})")
        self._reply(conn, reply)
        self._release()

    def _apply(self, op: str, args: list) -> tuple:
        data = self._data
        if op == "set":
            data[args[0]] = args[1]
        elif op == "add":
            value = int(data.get(args[0], b"0")) + args[1]
            data[args[0]] = str(value).encode()
            return ("ok", value)
        elif op == "compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
                return ("ok", desired)
            return ("ok", expected if current is None else current)
        elif op == "append":
            data[args[0]] = data.get(args[0], b"") + args[1]
        elif op == "multi_set":
            data.update(zip(args[0], args[1], strict=True))
        elif op == "check":
            return ("ok", all(key in data for key in args[0]))
        elif op == "delete_key":
            return ("ok", data.pop(args[0], None) is not None)
        elif op == "num_keys":
            return ("ok", len(data))
        else:
            return ("error", f"rendezvous store: unknown operation {op!r}")
        return ("ok", None)

    def _release(self) -> None:
        """Answer every blocked get/wait whose keys all exist now."""
        waiting, self._blocked = self._blocked, []
        for conn, keys, deadline, op in waiting:
            if not all(key in self._data for key in keys):
                self._blocked.append((conn, keys, deadline, op))
                continue
            values = [self._data[key] for key in keys]
            self._reply(conn, ("ok", {"get": values[0], "multi_get": values}.get(op)))

    def _expire(self) -> None:
        now = time.monotonic()
        waiting, self._blocked = self._blocked, []
        for conn, keys, deadline, op in waiting:
            if deadline >= now:
                self._blocked.append((conn, keys, deadline, op))
                continue
            missing = [key for key in keys if key not in self._data]
            self._reply(conn, ("timeout", f"rendezvous store: keys {missing} were not set in time"))

    def _reply(self, conn: Connection, reply: tuple) -> None:
        try:
            conn.send(reply)
        except OSError:
            self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        self._blocked = [entry for entry in self._blocked if entry[0] is not conn]
        if conn in self._conns:
            self._conns.remove(conn)
        conn.close()


def _store_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: Any, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class TokenStore(dist.Store):
    """A ``torch.distributed`` store whose keys live in a ``StoreServer``; a rank gets one
    from ``connect_store``. Safe to share between threads (one request at a time)."""

    def __init__(self, conn: Connection, timeout_s: float) -> None:
        super().__init__()
        self._conn = conn
        self._timeout_s = timeout_s
        self._lock = threading.Lock()

    def _ask(self, *request: Any) -> Any:
        with self._lock:
            try:
                self._conn.send(request)
                status, value = self._conn.recv()
            except (EOFError, OSError) as err:
                raise dist.DistStoreError(
                    "rendezvous store: the launching process closed the connection (it "
                    "stopped, or this rank was stopped)"
                ) from err
        if status != "ok":
            raise dist.DistStoreError(value)
        return value

    def set(self, key: str, value: Any) -> None:
        self._ask("set", key, _store_bytes(value))

    def get(self, key: str) -> bytes:
        return self._ask("get", key, self._timeout_s)

    def add(self, key: str, value: int) -> int:
        return self._ask("add", key, int(value))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._ask(
            "compare_set", key, _store_bytes(expected_value), _store_bytes(desired_value)
        )

    def append(self, key: str, value: Any) -> None:
        self._ask("append", key, _store_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._ask("multi_get", list(keys), self._timeout_s)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._ask("multi_set", list(keys), [_store_bytes(v) for v in values])

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._ask("wait", list(keys), _seconds(timeout, self._timeout_s))

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._ask("delete_key", key)

    def num_keys(self) -> int:
        return self._ask("num_keys")


def connect_store(port: int, token: bytes, rank: int, timeout_s: float) -> TokenStore:
    """Rank ``rank``'s client of the ``StoreServer`` on 127.0.0.1:``port``; ``get`` and
    ``wait`` give up after ``timeout_s``."""
    return TokenStore(token_connect(port, token, STORE_PURPOSE, rank), timeout_s)


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
    store_port: int,
    token: bytes,
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
    pin_to_loopback(os.environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
    )
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        store = connect_store(store_port, token, rank, timeout_s)
        state = init_parallel(
            layout.pp, layout.tp, layout.dcp, backend=backend, timeout_s=timeout_s, store=store
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

    Each process is spawned (fresh interpreter), joins a process group through a private
    ``StoreServer`` of this process and gets a ``ParallelState`` for the layout ``pp x tp``
    (``tp`` defaults to ``nprocs // pp``) with DCP groups of ``dcp``. ``fn`` must be
    importable (module level) and its return value picklable.

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
    # The token reaches each rank inside its spawn arguments, through a pipe of its own.
    token = secrets.token_bytes(TOKEN_BYTES)
    store = StoreServer(token, nprocs)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                os.getpid(),
                rank,
                nprocs,
                store.port,
                token,
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
        store.close()
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
    # that raised always reports before it exits, so one that died silently is the cause;
    # its peers' reports can beat its death to us, so give a death a moment to show.
    if errors and not silent_deaths():
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not silent_deaths():
            _drain(results, outputs, errors, timeout=0.1)
        if silent_deaths():
            _drain(results, outputs, errors, timeout=1.0)  # a report sent just before it
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
