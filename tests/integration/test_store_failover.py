"""A store that outlives its server: a standby keeps a copy and takes over, clients fail over.

Real servers in processes of their own, killed with SIGKILL or stopped with SIGSTOP; the
standby and the clients talk to them over real sockets.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

from tdist._core.errors import AuthenticationError, DistNetworkError, DistStoreError
from tdist.store._replica import FailoverStore, StoreStandby
from tdist.store._tcp import TCPStore

pytestmark = pytest.mark.timeout(60)

_T = timedelta(seconds=10)


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    monkeypatch.setenv("TDIST_SECRET", "failover-secret")
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=_T)
    yield store
    store.close()


def _kill(master: TCPStore, sig: int = signal.SIGKILL) -> None:
    assert master._server is not None and master._server.pid is not None
    os.kill(master._server.pid, sig)


def _standby(master: TCPStore, silence: float = 10.0) -> StoreStandby:
    standby = StoreStandby("127.0.0.1", master.port, timeout=_T, silence=silence)
    assert standby.synced.wait(10)
    return standby


def test_the_standby_has_every_change_and_serves_it_when_the_server_is_killed(master: TCPStore) -> None:
    master.set("before", b"copied whole")
    master.queue_push("q", b"first")
    standby = _standby(master)
    try:
        client = FailoverStore("127.0.0.1", master.port, timeout=_T)
        assert client.refresh() == [standby.address]
        client.set("k", "v")
        assert client.add("n", 5) == 5
        assert client.compare_set("cas", "", "one") == b"one"
        assert client.compare_set("cas", "one", "two") == b"two"
        client.multi_set(["m1", "m2"], ["a", "b"])
        client.append("ap", "x")
        client.append("ap", "y")
        client.set("gone", "soon")
        assert client.delete_key("gone")
        client.queue_push("q", "second")
        client.queue_push("q", "third")
        assert client.queue_pop("q") == b"first"
        master.set("from the master", b"too")
        keys = sorted(master.list_keys())
        assert not standby.serving
        _kill(master)
        # the next call finds the server gone, waits for the standby and runs there
        assert client.get("k") == b"v"
        assert standby.serving and client.address == standby.address
        assert sorted(client.list_keys()) == keys
        assert client.multi_get(["before", "n", "cas", "m1", "m2", "ap", "from the master"]) == [
            b"copied whole", b"5", b"two", b"a", b"b", b"xy", b"too"]
        assert not client.check(["gone"])
        assert client.queue_len("q") == 2 and client.queue_pop("q") == b"second"
        assert client.add("n", 1) == 6  # (the copy goes on from where the server was)
        client.close()
    finally:
        standby.stop()


@pytest.mark.parametrize("serves", [True, False])
def test_a_standby_serves_torchs_clients_where_its_server_did(serves: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """tdist run's job store has a secret and serves torch's own clients (a torch program's
    TCPStore): so does the standby that takes over from it; one of a store that refuses them
    refuses them too."""
    import torch.distributed as tdd

    from tdist.store._server import StoreServer

    monkeypatch.setenv("TDIST_SECRET", "failover-secret")
    server = StoreServer("127.0.0.1", 0, torch_clients=serves)
    server.start("thread")
    took_over = threading.Event()
    standby = StoreStandby("127.0.0.1", server.port, timeout=_T, silence=10.0, on_takeover=lambda _: took_over.set())
    try:
        assert standby.synced.wait(10)
        server.stop()  # (its connections close: the standby takes over)
        assert took_over.wait(10) and standby.serving
        port = int(standby.address.rpartition(":")[2])
        if serves:
            client = tdd.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
            client.set("k", "v")
            assert client.get("k") == b"v"
            del client
        else:
            with pytest.raises(tdd.DistError):
                tdd.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)
    finally:
        standby.stop()


def test_a_wait_under_way_goes_on_at_the_standby(master: TCPStore) -> None:
    standby = _standby(master)
    try:
        waiter = FailoverStore("127.0.0.1", master.port, timeout=_T)
        waiter.refresh()
        entered = threading.Event()
        result: list[object] = []

        def wait() -> None:
            entered.set()
            try:
                result.append(waiter.get("later"))  # (blocks: the key is not there yet)
            except Exception as exc:
                result.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        assert entered.wait(5)
        _kill(master)
        setter = TCPStore("127.0.0.1", int(standby.address.rsplit(":", 1)[1]), timeout=_T)
        setter.set("later", b"set at the standby")
        thread.join(20)
        assert result == [b"set at the standby"]
        setter.close()
        waiter.close()
    finally:
        standby.stop()


def test_a_call_that_must_not_run_twice_says_its_outcome_is_unknown(master: TCPStore) -> None:
    standby = _standby(master)
    try:
        client = FailoverStore("127.0.0.1", master.port, timeout=_T)
        client.refresh()
        assert client.add("n", 1) == 1
        _kill(master)
        with pytest.raises(DistNetworkError, match="may or may not have been applied"):
            client.add("n", 1)
        assert client.address == standby.address
        assert client.add("n", 1) == 2  # (it was not: the server was already gone)
        client.close()
    finally:
        standby.stop()


def test_one_standby_at_a_time_and_only_with_the_secret(master: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    standby = _standby(master)
    try:
        with pytest.raises(DistStoreError, match="already has a standby"):
            StoreStandby("127.0.0.1", master.port, timeout=_T)
        monkeypatch.setenv("TDIST_SECRET", "not-the-secret")
        with pytest.raises(AuthenticationError):
            StoreStandby("127.0.0.1", master.port, timeout=_T)
    finally:
        standby.stop()
    # a standby that stops makes room for another
    monkeypatch.setenv("TDIST_SECRET", "failover-secret")
    client = TCPStore("127.0.0.1", master.port, timeout=_T)
    second = StoreStandby("127.0.0.1", master.port, timeout=_T)
    try:
        assert second.synced.wait(10)
        master.set("x", b"1")
        client.close()
    finally:
        second.stop()


def test_a_stopped_server_is_taken_over_after_the_silence(master: TCPStore) -> None:
    """SIGSTOP: no end of connection, only silence; the standby takes over after ``silence``
    and a client whose call stalls fails over to it."""
    standby = _standby(master, silence=1.0)
    client = FailoverStore("127.0.0.1", master.port, timeout=timedelta(seconds=1))
    try:
        client.refresh()
        client.set("k", "v")
        _kill(master, signal.SIGSTOP)
        assert client.check(["k"])  # (stalls for its timeout, then fails over)
        assert client.address == standby.address
    finally:
        _kill(master, signal.SIGCONT)
        client.close()
        standby.stop()


def test_the_server_that_took_over_gets_a_standby_of_its_own(master: TCPStore) -> None:
    first = _standby(master)
    client = FailoverStore("127.0.0.1", master.port, timeout=_T)
    try:
        client.refresh()
        client.set("k", "1")
        _kill(master)
        assert client.get("k") == b"1"
        host, port = first.address.rsplit(":", 1)
        second = StoreStandby(host, int(port), timeout=_T)
        try:
            assert second.synced.wait(10)
            assert client.refresh() == [second.address]
            client.set("k", "2")
            assert first.server is not None
            first.server.stop()  # (the second server goes too: its standby serves on)
            assert client.get("k") == b"2" and client.address == second.address
        finally:
            second.stop()
    finally:
        client.close()
        first.stop()


def test_a_standby_that_is_gone_too_is_not_waited_for(master: TCPStore) -> None:
    """The standby stopped before the server was lost: its port refuses, so the client says at
    once that nothing took over (it does not wait for a standby that might still take over)."""
    standby = _standby(master)
    client = FailoverStore("127.0.0.1", master.port, timeout=timedelta(seconds=60))
    try:
        client.refresh()
        standby.stop()
        _kill(master)
        with pytest.raises(DistNetworkError, match=r"no standby \(none left\) took over"):
            client.get("k")
    finally:
        client.close()


def test_a_standby_that_follows_the_thread_follows_the_process_that_takes_over(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.store._server import StoreServer

    gate = threading.Event()
    monkeypatch.setattr(StoreServer, "handover_gate", gate)  # (the standby comes first)
    monkeypatch.setenv("TDIST_SECRET", "failover-secret")
    monkeypatch.delenv("TDIST_STORE_SERVER", raising=False)
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=_T)
    try:
        server = master._server
        assert server is not None and not server._handed_over
        master.set("before", b"the hand-over")
        standby = _standby(master)
        try:
            gate.set()
            server._send(b".")
            assert server.pid is not None and server._handed_over
            master.set("after", b"the hand-over")
            client = FailoverStore("127.0.0.1", master.port, timeout=_T)
            assert client.refresh() == [standby.address]
            _kill(master)
            assert client.multi_get(["before", "after"]) == [b"the hand-over", b"the hand-over"]
            assert standby.serving
            client.close()
        finally:
            standby.stop()
    finally:
        master.close()
