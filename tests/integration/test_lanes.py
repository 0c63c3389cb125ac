"""Shared-memory lanes under a process group's endpoint: small messages between ranks of one
host go by lane, larger ones by socket or cross-memory copy, and a receiver matches them in
the order they were sent, whichever way each went."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Any

import pytest
import torch

import tdist
from tdist.testing import run_processes, run_threads
from tdist.transport import Endpoint
from tdist.transport._lane import MAX_RECORD

from .._sync import wait_until

pytestmark = pytest.mark.timeout(60)


def view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _endpoint(store: Any, rank: int, n: int, **kwargs: Any) -> Endpoint:
    ep = Endpoint(tdist.PrefixStore("g", store), rank, n, timeout=10, **kwargs)
    ep.enable_lanes()
    return ep


def _recv(ep: Endpoint, src: int, tag: int, out: torch.Tensor) -> torch.Tensor:
    ep.wait(ep.post_recv(src, tag, view(out)), time.monotonic() + 10)
    return out


# sizes that go every way: by lane, by socket (too large for a lane, too small to copy across
# processes) and by cross-memory copy; the lane fills up under the 30 KB run (then by socket)
SIZES = [1, 7000, 300_000, 1, 7500, 1, *([7600] * 40), 1]


def _mixed(rank: int, n: int, store: Any, secret: str | None) -> list[str]:
    ep = _endpoint(store, rank, n, secret=secret)  # (with a secret, socket frames are sealed; lanes are not sockets)
    try:
        peer = 1 - rank
        # a first exchange: the lanes are offered, mapped and answered
        for i in range(2):
            if rank == 0:
                ep.send(peer, 9, [view(torch.tensor([float(i)]))])
                _recv(ep, peer, 9, torch.empty(1))
            else:
                _recv(ep, peer, 9, torch.empty(1))
                ep.send(peer, 9, [view(torch.tensor([float(i)]))])
        deadline = time.monotonic() + 10
        while not ep._peers[peer].lane_ready and time.monotonic() < deadline:
            time.sleep(0.001)
        if rank == 0:  # everything sent before anything is received, one tag
            for i, size in enumerate(SIZES):
                ep.send(peer, 1, [view(torch.full((size,), float(i)))])
        else:
            for i, size in enumerate(SIZES):
                got = _recv(ep, peer, 1, torch.empty(size))
                assert torch.equal(got, torch.full((size,), float(i))), (i, size, got[:4])
        # the other way, received as it comes
        if rank == 1:
            for i, size in enumerate(SIZES):
                ep.send(peer, 2, [view(torch.full((size,), float(-i)))])
        else:
            for i, size in enumerate(SIZES):
                got = _recv(ep, peer, 2, torch.empty(size))
                assert torch.equal(got, torch.full((size,), float(-i))), (i, size, got[:4])
        ep.send(peer, 3, [b"done"])
        ep.wait(ep.post_recv(peer, 3), time.monotonic() + 10)
        return ["lane" if ep._peers[peer].lane_ready else "socket", "in" if ep._peers[peer].lane_in else "-"]
    finally:
        ep.close()


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_messages_that_go_different_ways_are_received_in_the_order_they_were_sent(secret: str | None) -> None:
    assert 7600 * 4 * 9 > 256 << 10 and 7600 * 4 < MAX_RECORD  # (the run fills the lane)
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        results = run_processes(_mixed, 2, master, secret, timeout=60)
    finally:
        master.close()
    assert results == [["lane", "in"], ["lane", "in"]]


def test_any_source_and_tags_out_of_order_over_lanes() -> None:
    store = tdist.HashStore()

    def body(rank: int, n: int) -> list[int]:
        ep = _endpoint(store, rank, n)
        try:
            if rank == 0:
                sources = []
                for _ in range(3 * (n - 1)):
                    h = ep.post_recv(-1, 5)
                    ep.wait(h, time.monotonic() + 10)
                    assert h.data == f"{h.source}".encode()
                    sources.append(h.source)
                # tags received in another order than sent
                for q in range(1, n):
                    b, a = torch.empty(1), torch.empty(1)
                    hb = ep.post_recv(q, 8, view(b))
                    ha = ep.post_recv(q, 7, view(a))
                    ep.wait(hb, time.monotonic() + 10)
                    ep.wait(ha, time.monotonic() + 10)
                    assert (a.item(), b.item()) == (q * 10 + 7, q * 10 + 8)
                return sorted(sources)
            for _ in range(3):
                ep.send(0, 5, [f"{rank}".encode()])
            ep.send(0, 7, [view(torch.tensor([float(rank * 10 + 7)]))])
            ep.send(0, 8, [view(torch.tensor([float(rank * 10 + 8)]))])
            return []
        finally:
            if rank == 0:
                for q in range(1, n):
                    ep.send(q, 6, [b"bye"])
            else:
                ep.wait(ep.post_recv(0, 6), time.monotonic() + 10)
            ep.close()

    out = run_threads(body, 3, timeout=30)
    assert out[0] == [1, 1, 1, 2, 2, 2]


def test_a_receiver_asleep_past_its_spin_is_woken_by_a_lane_message() -> None:
    store = tdist.HashStore()
    waiting = threading.Event()
    received = threading.Event()

    def body(rank: int, n: int) -> float:
        # (a waiter also looks at the lanes each time its wait's step ends, half a heartbeat
        # interval: 10 s here, so only the producer's wake-up can end its wait within 5 s)
        ep = _endpoint(store, rank, n, heartbeat_interval=20.0, stall_timeout=60.0)
        try:
            peer = 1 - rank
            for _ in range(2):  # (the lanes are offered and answered)
                ep.send(peer, 1, [b"x"])
                ep.wait(ep.post_recv(peer, 1), time.monotonic() + 10)
            deadline = time.monotonic() + 10
            while not ep._peers[peer].lane_ready and time.monotonic() < deadline:
                time.sleep(0.001)
            ep.send(peer, 2, [b"y"])  # (both lanes answered once this is through)
            ep.wait(ep.post_recv(peer, 2), time.monotonic() + 10)
            if rank == 1:
                h = ep.post_recv(0, 3)
                waiting.set()
                t = time.monotonic()
                ep.wait(h, time.monotonic() + 30)
                assert h.data == b"late"
                assert time.monotonic() - t < 5.0
                received.set()
                return 0.0
            assert waiting.wait(10)
            lane = ep._peers[peer].lane_out
            assert lane is not None
            # (a slow sender: it sends once the receiver has spun its budget and sleeps)
            wait_until(lambda: lane.sleepers() == 1, 10, "the receiver sleeps on the lane")
            ep.send(peer, 3, [b"late"])
            assert received.wait(20)  # (no frame of ours, a goodbye included, may wake it meanwhile)
            return 0.0
        finally:
            ep.close()

    run_threads(body, 2, timeout=30)


def _send_and_exit(port: int) -> None:
    store = tdist.TCPStore("127.0.0.1", port)
    ep = _endpoint(store, 0, 2)
    ep.send(1, 1, [b"x"])
    ep.wait(ep.post_recv(1, 1), time.monotonic() + 10)  # (its receives are posted now)
    deadline = time.monotonic() + 10
    while not ep._peers[1].lane_ready and time.monotonic() < deadline:
        time.sleep(0.001)
    if not ep._peers[1].lane_ready:
        os._exit(3)
    for i in range(20):
        ep.send(1, 2, [view(torch.tensor([float(i)]))])
    os._exit(0)  # (gone at once, nothing closed: what it sent is in its lane, which the receiver maps)


def test_what_a_rank_put_in_its_lane_before_it_exited_reaches_its_posted_receives() -> None:
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True)
    sender = multiprocessing.get_context("fork").Process(target=_send_and_exit, args=(master.port,))
    sender.start()
    ep = None
    try:
        ep = Endpoint(tdist.PrefixStore("g", master), 1, 2, timeout=10)
        ep.wait(ep.post_recv(0, 1), time.monotonic() + 10)
        outs = [torch.empty(1) for _ in range(20)]
        handles = [ep.post_recv(0, 2, view(t)) for t in outs]
        ep.send(0, 1, [b"go"])
        sender.join(20)
        assert sender.exitcode == 0  # (it used its lane, and is gone)
        deadline = time.monotonic() + 10  # (nobody waits on the receives: its reader, at the loss, reads the lane)
        while ep._peers[0].error is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ep._peers[0].error is not None
        assert [h.finished and h.error is None for h in handles] == [True] * 20
        assert [t.item() for t in outs] == [float(i) for i in range(20)]
        assert ep._peers[0].lane_in is not None
    finally:
        if sender.is_alive():
            sender.kill()
        if ep is not None:
            ep.close()
        master.close()
