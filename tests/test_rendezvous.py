"""The private single-node rendezvous: ``StoreServer`` / ``connect_store`` / ``TokenListener``.

A local stranger (any process that did not get the one-time token) can neither read nor write
the keys, whatever it sends; silent connections delay no rank; the engine stops listening once
its ranks joined and pins gloo and NCCL/RCCL to loopback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import secrets
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch.distributed as dist

from rocm_mla import distributed
from rocm_mla.distributed import (
    TOKEN_BYTES,
    StoreServer,
    TokenListener,
    connect_store,
    pin_to_loopback,
)
from rocm_mla.engine import LLM
from rocm_mla.engine import llm as llm_module
from rocm_mla.models.kimi_k3 import KimiK3Config, make_tiny
from tests.test_robust import _listening_ports, _socket_inodes

STRAYS = 12


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the other end closed ``sock`` within ``within_s`` (without sending data)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def server():
    token = secrets.token_bytes(TOKEN_BYTES)
    server = StoreServer(token, 2)
    yield server, token
    server.close()


def test_a_stranger_without_the_token_can_neither_read_nor_write(server):
    server, token = server
    rank0 = connect_store(server.port, token, 0, 10.0)
    rank0.set("gloo/addr0", b"\x7f\x00\x00\x01 pointer-like bytes")

    # torch's own client speaks TCPStore's protocol: it is never answered.
    with pytest.raises(RuntimeError):
        dist.TCPStore("127.0.0.1", server.port, 2, False, datetime.timedelta(seconds=2))
    # Our client with a wrong token (right length, purpose and a free rank): cut off.
    wrong = connect_store(server.port, secrets.token_bytes(TOKEN_BYTES), 1, 2.0)
    for attempt in (
        lambda: wrong.get("gloo/addr0"),
        lambda: wrong.num_keys(),
        lambda: wrong.set("gloo/addr0", b"evil"),
        lambda: wrong.add("evil", 1),
        lambda: wrong.delete_key("gloo/addr0"),
        lambda: wrong.check(["gloo/addr0"]),
    ):
        with pytest.raises(dist.DistStoreError, match="closed the connection"):
            attempt()
    # A pickled request sent first, without any token: closed unread (never unpickled).
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(pickle.dumps(("num_keys",)) + b"\0" * 64)
    assert _closed_by_peer(raw, 5.0)
    raw.close()
    # The token holder's rank again, from a stranger that learnt the token only in part.
    half = token[: TOKEN_BYTES // 2] + bytes(TOKEN_BYTES // 2)
    with pytest.raises(dist.DistStoreError):
        connect_store(server.port, half, 1, 2.0).set("evil", b"1")

    assert rank0.num_keys() == 1
    assert rank0.get("gloo/addr0") == b"\x7f\x00\x00\x01 pointer-like bytes"
    assert not rank0.check(["evil"])
    # A second client claiming a rank that already joined is refused, even with the token.
    with pytest.raises(dist.DistStoreError):
        connect_store(server.port, token, 0, 2.0).num_keys()

    rank1 = connect_store(server.port, token, 1, 10.0)
    assert rank1.get("gloo/addr0") == b"\x7f\x00\x00\x01 pointer-like bytes"
    deadline = time.monotonic() + 5.0
    while server.listening and time.monotonic() < deadline:
        time.sleep(0.01)
    # Every rank joined: nothing listens any more, so nobody else can even connect.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2.0)


def test_silent_connections_delay_no_rank_and_are_dropped(server, monkeypatch):
    server, token = server
    monkeypatch.setattr(distributed, "HANDSHAKE_TIMEOUT_S", 1.0)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(STRAYS)]
    # Some send part of a hello and then nothing: a reader that waits for a whole message
    # would sit on each of them.
    for sock in silent[::2]:
        sock.sendall(token[:5])
    time.sleep(0.2)  # they are accepted and pending before the ranks come
    start = time.monotonic()
    stores = [connect_store(server.port, token, rank, 10.0) for rank in range(2)]
    stores[0].set("k", b"v")
    assert stores[1].get("k") == b"v"
    assert time.monotonic() - start < 1.0
    assert all(_closed_by_peer(sock, 5.0) for sock in silent)
    for sock in silent:
        sock.close()


def test_store_operations_match_torchs_hash_store(server):
    server, token = server
    ours = connect_store(server.port, token, 0, 0.5)
    theirs = dist.HashStore()
    for store in (ours, theirs):
        store.set("s", "text")
        store.set("b", b"\x00\xff")
    for ask in (
        lambda s: s.get("s"),
        lambda s: s.get("b"),
        lambda s: s.add("n", 3),
        lambda s: s.add("n", -1),
        lambda s: s.get("n"),
        lambda s: s.compare_set("n", b"2", b"7"),
        lambda s: s.compare_set("n", b"2", b"8"),
        lambda s: s.compare_set("new", b"", b"x"),
        lambda s: s.compare_set("absent", b"y", b"z"),
        lambda s: s.check(["s", "n"]),
        lambda s: s.check(["s", "absent"]),
        lambda s: s.num_keys(),
        lambda s: s.delete_key("new"),
        lambda s: s.delete_key("new"),
        lambda s: s.multi_get(["s", "b"]),
        lambda s: (s.multi_set(["m1", "m2"], [b"1", "2"]), s.get("m1"), s.get("m2")),
        lambda s: (s.append("s", b"+"), s.get("s")),
    ):
        assert ask(ours) == ask(theirs)
    # get/wait for a key nobody sets gives up after the client's timeout, naming the key.
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="never-set"):
        ours.get("never-set")
    with pytest.raises(dist.DistStoreError, match="never-set"):
        ours.wait(["s", "never-set"])
    assert time.monotonic() - start < 5.0
    ours.wait(["s", "n"])  # present: returns at once


def test_a_blocked_get_returns_when_another_rank_sets_the_key(server):
    server, token = server
    reader = connect_store(server.port, token, 0, 30.0)
    writer = connect_store(server.port, token, 1, 30.0)
    got = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late")))
    thread.start()
    time.sleep(0.3)
    assert not got
    writer.set("late", b"here")
    thread.join(timeout=5.0)
    assert got == [b"here"]


def test_token_listener_refuses_bad_arguments():
    with pytest.raises(ValueError, match="32-byte token"):
        TokenListener(b"short", 2, b"S")
    with pytest.raises(ValueError, match="1-byte purpose"):
        TokenListener(bytes(TOKEN_BYTES), 2, b"SS")


def test_loopback_pinning_keeps_what_the_user_set():
    if not os.path.exists("/sys/class/net/lo"):
        pytest.skip("no loopback interface named lo on this host")
    env: dict[str, str] = {}
    pin_to_loopback(env)
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    env = {"NCCL_SOCKET_IFNAME": "eth1"}
    pin_to_loopback(env)
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "eth1"}


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    config = KimiK3Config.tiny("kimi_linear")
    config.max_position_embeddings = 64
    return str(make_tiny("kimi_linear", tmp_path_factory.mktemp("rdv") / "kl", config=config))


class _Crowded(TokenListener):
    """A listener that ``STRAYS`` silent strangers connect to the moment it listens, before
    any worker can, and one that presents a guessed token and asks for the keys."""

    silent: ClassVar[list[socket.socket]] = []
    guessed: ClassVar[list[socket.socket]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.silent.extend(
            socket.create_connection(("127.0.0.1", self.port)) for _ in range(STRAYS)
        )
        for purpose in (b"S", b"C"):
            sock = socket.create_connection(("127.0.0.1", self.port))
            sock.sendall(bytes(TOKEN_BYTES) + purpose + bytes(4) + pickle.dumps(("num_keys",)))
            self.guessed.append(sock)


def _start_s(tiny: str) -> float:
    start = time.monotonic()
    llm = LLM(tiny, pp=2, block_size=4, device="cpu")
    elapsed = time.monotonic() - start
    llm.close()
    return elapsed


@pytest.mark.slow
def test_engine_start_with_silent_strangers_is_not_delayed(tiny, monkeypatch):
    plain, crowded = [], []
    for _ in range(3):  # interleaved, so the box's load weighs on both alike
        plain.append(_start_s(tiny))
        with monkeypatch.context() as patch:
            patch.setattr(llm_module, "TokenListener", _Crowded)
            patch.setattr(distributed, "TokenListener", _Crowded)
            crowded.append(_start_s(tiny))
        assert all(_closed_by_peer(sock, 5.0) for sock in _Crowded.guessed)
        for sock in _Crowded.silent + _Crowded.guessed:
            sock.close()
        _Crowded.silent.clear()
        _Crowded.guessed.clear()
    print(
        f"LLM(pp=2) start, median of {len(plain)}: {statistics.median(plain):.2f} s plain, "
        f"{statistics.median(crowded):.2f} s with {STRAYS} silent strangers per listener"
    )
    # The other work on a shared box only ever adds time, so the fastest start of each kind
    # is the fair comparison (the old accept loop waited 5 s per silent connection).
    assert min(crowded) - min(plain) < 1.0, (plain, crowded)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
def test_engine_listens_on_nothing_once_started_and_pins_loopback(tiny, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    before = set(_listening_ports(_socket_inodes([os.getpid()])))
    with LLM(tiny, pp=2, block_size=4, device="cpu") as llm:
        assert llm.generate([[1, 2, 3]], 2)
        # The store and control listeners closed once both ranks joined.
        assert set(_listening_ports(_socket_inodes([os.getpid()]))) - before == set()
        assert not llm._group._store.listening
        if os.path.exists("/sys/class/net/lo"):
            for pid in llm.worker_pids:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert b"NCCL_SOCKET_IFNAME=lo" in environ
                assert b"GLOO_SOCKET_IFNAME=lo" in environ
