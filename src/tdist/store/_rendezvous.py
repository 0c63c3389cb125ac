"""``init_method`` URLs to ``(store, rank, world_size)``: ``torch.distributed.rendezvous``.

Theory of operation. A rendezvous handler is a generator function registered for a URL scheme;
``rendezvous(url)`` returns the generator and ``next()`` on it performs the rendezvous and
yields the triple once. Asking for a second triple (a re-rendezvous) raises, as torch does: the
static methods here cannot reconfigure a job.

Three handlers ship, with torch's URLs, defaults and error messages:

* ``env://`` reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` (``?rank=`` and
  ``?world_size=`` in the URL override the last two; rank 0 needs no ``MASTER_ADDR``, as in
  torch 0.3);
* ``tcp://host:port?rank=R&world_size=N`` (a multicast address, torch 0.3's automatic ranks,
  is refused, saying so);
* ``file:///path?rank=R&world_size=N`` (a ``FileStore``; without ``rank`` the processes take
  ranks in the order they reach the file, as torch 0.3's automatic assignment).

For ``env://`` and ``tcp://`` rank 0 hosts the ``TCPStore`` server (shared by every store this
process creates on that address) and the other ranks connect to it. Under ``tdist run`` (or
torchrun) ``TORCHELASTIC_USE_AGENT_STORE=True`` says that the launcher already hosts the server:
every rank is then a client, and the store is namespaced per restart attempt with
``PrefixStore("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", store)`` so that keys left by a
failed attempt cannot confuse the next one. Under torch's own torchrun that server is torch's C++
``TCPStore`` (no ``TDIST_AGENT_STORE``; it does not greet a new connection as tdist's does), and
the ranks join it with torch's client.

Thread-safety: the handler registry may be used from several threads.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse, urlunparse

from .._core import patience
from .._core._process import gone_here, pid_alive, pid_space
from .._core.errors import DistNetworkError, StoreTimeoutError
from ._api import Store, multi_get_within
from ._protocol import OPENING, OPENING_ECHO

__all__ = ["RendezvousHandler", "register_rendezvous_handler", "rendezvous"]

log = logging.getLogger(__name__)

#: A rendezvous handler: ``handler(url, **kwargs)`` returns an iterator of triples.
RendezvousHandler = Callable[..., Iterator[tuple[Store, int, int]]]

#: torch's ``default_pg_timeout``: the default timeout of the stores made here.
DEFAULT_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)

_handlers_lock = threading.Lock()
_rendezvous_handlers: dict[str, RendezvousHandler] = {}


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Register ``handler`` for URLs of the form ``scheme://...``.

    Args:
        scheme: the URL scheme that selects the handler (``"env"``, ``"tcp"``, ...).
        handler: a generator function ``handler(url, **kwargs)`` that yields
            ``(store, rank, world_size)``.

    Raises:
        RuntimeError: a handler is already registered for ``scheme``.
    """
    with _handlers_lock:
        if scheme in _rendezvous_handlers:
            raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
        _rendezvous_handlers[scheme] = handler


def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """Start the rendezvous that ``url`` describes; ``next()`` on the result performs it.

    Args:
        url: an ``init_method`` URL: ``env://``, ``tcp://host:port``, ``file:///path`` or a
            scheme registered with ``register_rendezvous_handler``.
        rank: this process's rank, or -1 to take it from the URL (or the environment).
        world_size: the number of processes, or -1 to take it from the URL (or environment).
        **kwargs: passed to the handler; the built-in ``env``/``tcp`` handlers take ``timeout``
            (a ``timedelta``, default 30 minutes), the store's default timeout.

    Returns:
        An iterator that yields ``(store, rank, world_size)`` once; asking it again raises
        ``RuntimeError`` (re-rendezvous is not possible with these methods).

    Raises:
        RuntimeError: ``url``, ``rank`` or ``world_size`` has the wrong type, or no handler is
            registered for the scheme.
        AssertionError: ``rank``/``world_size`` are given both as arguments and in the URL
            (as torch).
    """
    if isinstance(url, bytes):
        url = url.decode()
    if not isinstance(url, str):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise RuntimeError(f"`rank` must be an integer. {rank}")
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise RuntimeError(f"`world_size` must be an integer. {world_size}")
    return _rendezvous_helper(url, int(rank), int(world_size), **kwargs)


def _rendezvous_helper(
    url: str, rank: int, world_size_opt: int | None, **kwargs: Any
) -> Iterator[tuple[Store, int, int]]:
    """torch's helper: fold ``rank``/``world_size`` into the URL's query, pick the handler.

    ``world_size_opt=None`` (used when a backend makes its own store) reads ``RANK`` and
    ``WORLD_SIZE`` from the environment for ``env://``.
    """
    result = urlparse(url)
    if world_size_opt is None:
        world_size = -1
        if result.scheme == "env":
            rank = _parse_int(os.environ.get("RANK", str(rank)), "RANK", "env")
            world_size = _parse_int(os.environ.get("WORLD_SIZE", str(world_size)), "WORLD_SIZE", "env")
    else:
        world_size = world_size_opt
    if rank != -1 or world_size != -1 or world_size_opt is None:
        query = _query_to_dict(result.query, result.scheme)
        if "rank" in query or "world_size" in query:
            raise AssertionError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
        if rank != -1:
            query["rank"] = str(rank)
        if world_size != -1 or world_size_opt is None:
            query["world_size"] = str(world_size)
        result = result._replace(query="&".join(f"{k}={v}" for k, v in query.items()))
        url = urlunparse(result)

    with _handlers_lock:
        handler = _rendezvous_handlers.get(result.scheme)
    if handler is None:
        raise RuntimeError(f"No rendezvous handler for {result.scheme}://")
    return handler(url, **kwargs)


# -- helpers -----------------------------------------------------------------------------------
def _rendezvous_error(msg: str) -> ValueError:
    return ValueError("Error initializing torch.distributed using " + msg)


def _query_to_dict(query: str, scheme: str) -> dict[str, str]:
    """``"rank=0&world_size=1"`` to ``{"rank": "0", "world_size": "1"}`` (as torch)."""
    out: dict[str, str] = {}
    for pair in filter(None, query.split("&")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise _rendezvous_error(
                f"{scheme}:// rendezvous: malformed query parameter {pair!r}; expected key=value, "
                "e.g. ?rank=0&world_size=2"
            )
        out[key] = value
    return out


def _parse_int(value: str, name: str, scheme: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise _rendezvous_error(
            f"{scheme}:// rendezvous: {name} must be an integer, but was {value!r}"
        ) from None


def _check_rank(rank: int, world_size: int, scheme: str) -> None:
    if world_size != -1 and world_size < 1:
        raise _rendezvous_error(
            f"{scheme}:// rendezvous: world size must be positive, but was {world_size}"
        )
    if rank < 0 or (world_size != -1 and rank >= world_size):
        raise _rendezvous_error(
            f"{scheme}:// rendezvous: rank {rank} is out of range for world size {world_size}; "
            "ranks go from 0 to world_size - 1"
        )


def _check_port(port: int) -> int:
    if not 0 <= port < 2**16:
        raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
    return port


def _agent_store(hostname: str, port: int) -> tuple[str, int] | None:
    """The launcher's store, if one hosts this job's: ``TDIST_AGENT_STORE`` (``tdist run``:
    ``host:port``) when asked for the job's own ``MASTER_ADDR:MASTER_PORT`` (another address, a
    job of the worker's own, is left alone), or ``MASTER_ADDR:MASTER_PORT`` under
    ``TORCHELASTIC_USE_AGENT_STORE=True``."""
    named = os.environ.get("TDIST_AGENT_STORE")
    if named and (hostname, str(port)) == (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")):
        host, _, raw = named.rpartition(":")
        try:
            return host.strip("[]"), _check_port(int(raw))
        except ValueError:
            raise _rendezvous_error(
                f"environment variable TDIST_AGENT_STORE must be HOST:PORT, but was {named!r}"
            ) from None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", None) == str(True):
        return hostname, port
    return None


#: how long a new connection to the agent's store waits for its first answer
_GREETING_WAIT = 1.0


def _agent_is_torchs(hostname: str, port: int) -> bool:
    """Whether the agent's store at ``hostname:port`` is torch's, not a tdist server: so under
    torch's own ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE=True`` and no ``TDIST_AGENT_STORE``).
    A connection that opens as tdist's client does (``OPENING``) is answered at once by either:
    torch's server echoes its nonce (``OPENING_ECHO``), tdist's greets. A connection that fails,
    sees its end or hears nothing within ``_GREETING_WAIT`` is left to tdist's client to retry
    and report."""
    if os.environ.get("TDIST_AGENT_STORE"):
        return False
    try:
        sock = socket.create_connection((hostname, port), timeout=_GREETING_WAIT)
    except OSError:
        return False
    with sock:
        try:
            sock.sendall(OPENING)
            head = b""
            deadline = time.monotonic() + _GREETING_WAIT
            while len(head) < len(OPENING_ECHO) and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                data = sock.recv(len(OPENING_ECHO) - len(head))
                if not data:
                    break
                head += data
        except OSError:
            return False
    return head == OPENING_ECHO


def _torch_client(hostname: str, port: int, world_size: int | None, timeout: timedelta) -> Store:
    """A client of torchrun's store (torch's ``TCPStore``), as a tdist store."""
    from torch._C._distributed_c10d import TCPStore as TorchTCPStore

    from ._foreign import ForeignStore

    log.debug("the agent's store at %s:%d is torch's (torchrun): joining it with torch's client", hostname, port)
    store = TorchTCPStore(hostname, port, world_size, False, timeout=timeout, wait_for_workers=False)
    return ForeignStore(store)


def _use_libuv(query: dict[str, str]) -> bool:
    return query.get("use_libuv", os.environ.get("USE_LIBUV", "1")) == "1"


def _create_c10d_store(
    hostname: str, port: int, rank: int, world_size: int, timeout: timedelta, use_libuv: bool = True
) -> Store:
    """The store for ``rank``: rank 0 hosts the server unless the launcher's agent does.

    Under an agent (``tdist run``'s ``TDIST_AGENT_STORE``, or ``TORCHELASTIC_USE_AGENT_STORE=True``
    with ``MASTER_ADDR:MASTER_PORT``) every rank is a client and the store
    is namespaced by the restart attempt, so a restarted group never sees its predecessor's keys.
    """
    from ._server import port_taken
    from ._tcp import TCPStore

    _check_port(port)
    size: int | None = world_size if world_size > 0 else None
    agent = _agent_store(hostname, port)
    if agent is not None:
        hostname, port = agent
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log.debug("rank %d: client of the agent's store at %s:%d (attempt %s)", rank, hostname, port, attempt)
        agent_store: Store
        if _agent_is_torchs(hostname, port):
            agent_store = _torch_client(hostname, port, size, timeout)
        else:
            agent_store = TCPStore(
                host_name=hostname, port=port, world_size=size, is_master=False, timeout=timeout,
                use_libuv=use_libuv,
            )
        from ._prefix import PrefixStore

        # (and, under a dynamic rendezvous, of its round: a node that joins or leaves starts a
        # new round, where the count of restarts stays, and the store may be the same)
        rdzv_round = os.environ.get("TDIST_AGENT_ROUND")
        prefix = f"/worker/attempt_{attempt}" + (f"/round_{rdzv_round}" if rdzv_round else "")
        return PrefixStore(prefix, agent_store)
    log.debug("rank %d: %s the store at %s:%d", rank, "hosting" if rank == 0 else "joining", hostname, port)
    try:
        store = TCPStore(
            host_name=hostname,
            port=port,
            world_size=size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,  # (the checked join below waits, and says what is wrong)
            multi_tenant=True,
            use_libuv=use_libuv,
            _serve_later=size is not None,  # (serving once the checked join waits: ``TCPStore._serve_now``)
        )
    except DistNetworkError as exc:
        if rank != 0 or size is None or not port_taken(exc):
            raise
        _second_rank_zero(hostname, port, size, timeout, use_libuv, exc)
        raise
    if size is not None:
        try:
            _checked_join(store, rank, size, timeout, f"{hostname}:{port}")
        except BaseException:
            store.close()
            raise
        store._serve_now()  # (a round of one rank: it never waited)
    return store


def _second_rank_zero(hostname: str, port: int, size: int, timeout: timedelta, use_libuv: bool, exc: BaseException) -> None:
    """Rank 0 could not host the store: its port is taken. Where a store of this rendezvous
    answers there (another process was given rank 0 too), join it as rank 0: the checked join
    finds the claim and fails the round on every rank at once, naming both processes (raised
    here), where the other ranks would wait for the whole timeout for a rank that never comes.
    Nothing where no such store answers (the caller raises ``exc``)."""
    from ._tcp import TCPStore

    try:
        store = TCPStore(
            host_name=hostname, port=port, world_size=size, is_master=False,
            timeout=timedelta(seconds=min(5.0, timeout.total_seconds())), wait_for_workers=False,
            use_libuv=use_libuv,
        )
    except Exception:  # (not a store of ours, or of another job's secret: the port is just taken)
        return
    try:
        if not store.check([f"{_RDZV}/rank_0"]):  # (nobody claimed rank 0 there: not this rendezvous)
            return
        _checked_join(store, 0, size, timeout, f"{hostname}:{port}")
    finally:
        store.close()


# -- the checked join ------------------------------------------------------------------------------
# Every rank of a rendezvous with given ranks (env://, tcp://) joins a round of the store: it
# claims its rank and the world size, then waits until all have joined. Ranks that disagree on
# the world size, or two processes that claim one rank, fail at once on every rank that waits
# in that round (its "abort" key), naming both sides, where they would otherwise wait for the
# whole timeout (30 minutes, as in torch). A rank's round is its own count of joins on the store
# (the same store may host several groups in turn: a store retired by a destroyed group is taken
# back by the next one); a process's claim is released when its group is destroyed
# (``release_claim``), so that a process that claims a rank held by a live process elsewhere is a
# second process given that rank.
_RDZV = "tdist_rdzv"


def _holder_id() -> str:
    """``host|pid|nonce|pid space`` (``_process.pid_space``: where the pid means this process)."""
    return f"{socket.gethostname()}|{os.getpid()}|{uuid.uuid4().hex[:8]}|{pid_space()}"


def _describe_holder(value: str) -> str:
    host, _, rest = value.partition("|")
    pid = rest.partition("|")[0]
    return f"pid {pid} on {host}"


def _parse_claim(value: str) -> tuple[str, int, str | None] | None:
    """A claim's (``_holder_id``) host, pid and pid space (None in a claim without one), with
    or without its ``released|``; None where it is none."""
    fields = value.removeprefix("released|").split("|", 3)
    if len(fields) < 3 or not fields[1].isdigit():
        return None
    return fields[0], int(fields[1]), fields[3] if len(fields) == 4 else None


def _holder_gone(value: str) -> bool:
    """Whether the process that holds a claim is gone, or is this one (a group of ours that
    was not destroyed: an init that failed after its rendezvous); only known on this host, in
    this pid space (where the claim says which: ``_holder_id``)."""
    claim = _parse_claim(value)
    if claim is None:
        return False
    host, pid, space = claim
    if host != socket.gethostname() or (space is not None and space != pid_space()):
        return False
    return pid == os.getpid() or not pid_alive(pid)


def _checked_join(store: Any, rank: int, world_size: int, timeout: timedelta, where: str) -> None:
    """Join this rendezvous's round on ``store`` (see above).

    Raises:
        ValueError: ranks disagree on the world size, another process holds this rank, or the
            round was aborted by a rank that found one of those.
        StoreTimeoutError: not every rank joined within ``timeout`` (a ``DistStoreError``, as
            torch's, and a ``DistTimeoutError``).
    """

    me = _holder_id()
    n = int(store.add(f"{_RDZV}/rank_{rank}", 1))
    base = f"{_RDZV}/{n}/"

    def abort(round_base: str, message: str) -> ValueError:
        # (the round's "full" key says either: a round that is full is not aborted)
        message = f"the rendezvous at {where}: {message}"
        with contextlib.suppress(Exception):
            store.compare_set(round_base + "full", "", _ABORTED + message)
        return _rendezvous_error(message)

    if n > 1:  # this rank joined this store before: was the one before released?
        previous = f"{_RDZV}/{n - 1}/"
        with contextlib.suppress(StoreTimeoutError):
            store.wait([previous + f"rank_{rank}"], timedelta(seconds=5))
        held = store.get(previous + f"rank_{rank}").decode() if store.check([previous + f"rank_{rank}"]) else ""
        if held and not held.startswith("released|") and not _holder_gone(held):
            raise abort(
                previous,
                f"rank {rank} is claimed by two processes: {_describe_holder(held)} holds it, and "
                f"{_describe_holder(me)} claims it again; give every process its own rank (RANK / "
                "rank=)",
            )
    store.set(base + f"rank_{rank}", me)
    said = store.compare_set(base + "world_size", "", str(world_size)).decode()
    if said != str(world_size):
        raise abort(
            base,
            f"the ranks disagree on the world size: rank {rank} ({_describe_holder(me)}) says "
            f"{world_size}, an earlier rank said {said}; give every process the same world size "
            "(WORLD_SIZE / world_size=)",
        )
    if int(store.add(base + "joined", 1)) >= world_size:
        verdict = store.compare_set(base + "full", "", "1")  # (unless an abort came first)
    else:
        try:
            verdict = _wait_for_the_others(store, base, rank, world_size, timeout, where)
        except StoreTimeoutError:
            missing = _missing(store, base, world_size)
            message = (
                f"the rendezvous at {where} timed out after {timeout.total_seconds():g} s (rank {rank} "
                f"first): rank(s) {missing} of {world_size} never joined; are they running, with "
                "this address and world size?"
            )
            # (the round says so to the ranks that wait in it: they fail now too, with this
            # text, not later, or with a lost store when rank 0's process, its host, ends)
            verdict = store.compare_set(base + "full", "", _TIMED_OUT + message)
            if verdict == _TIMED_OUT.encode() + message.encode():
                raise StoreTimeoutError(f"rank {rank}: {message}") from None
    if verdict.startswith(_TIMED_OUT.encode()):
        raise StoreTimeoutError(f"rank {rank}: " + verdict.decode(errors="replace").removeprefix(_TIMED_OUT))
    if verdict != b"1":
        raise _rendezvous_error(verdict.decode(errors="replace").removeprefix(_ABORTED))
    store._rdzv_claim = (base + f"rank_{rank}", me)
    store._rdzv_round = n  # (every rank of the round has the same: the group's key namespace)


def _missing(store: Any, base: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([base + f"rank_{r}"])]




def _wait_for_the_others(store: Any, base: str, rank: int, world_size: int, timeout: timedelta, where: str) -> bytes:
    """The round's verdict, once every rank has joined (or one aborted it). A wait that goes on
    for 30 s is not silent: a warning names the ranks that have not come, then every minute;
    the round times out after ``timeout`` (30 minutes by default, as in torch), with no warning
    where it is shorter than the first.

    Raises:
        StoreTimeoutError: ``timeout`` passed.
    """
    total = timeout.total_seconds()
    start = time.monotonic()
    word = patience.FIRST
    while True:
        last = total <= word
        chunk = max(0.0, (total if last else word) - (time.monotonic() - start))
        try:  # (one request: tdist's TCPStore waits as long as asked)
            return multi_get_within(store, [base + "full"], timedelta(seconds=chunk))[0]
        except StoreTimeoutError:
            if last:
                raise
        missing = _missing(store, base, world_size)
        log.warning(
            "rank %d: waiting at the rendezvous at %s for rank(s) %s of %d (%.0f s so far; it times out after %s); "
            "are they running, with this address and world size?",
            rank, where, missing, world_size, time.monotonic() - start, timeout,
        )
        word += patience.EVERY


_ABORTED = "aborted: "
_TIMED_OUT = "timed out: "


def claims_gone(store: Any, size: int) -> Callable[[int], str | None] | None:
    """For the group of ``size`` ranks formed right after a checked join on ``store``:
    ``gone(rank)``, why that rank's process is known to have exited (one of this pid space:
    ``_process.gone_here``), else None; None where ``store`` had no checked join. The claims
    are read once, in one request, when first asked about (the caller asks only once ranks
    keep it waiting; every rank of the round claimed its rank before the round completed)."""
    n = getattr(store, "_rdzv_round", None)
    if n is None:
        return None
    claims: list[str] = []

    def gone(rank: int) -> str | None:
        if not claims:
            try:
                claims.extend(v.decode(errors="replace") for v in store.multi_get([f"{_RDZV}/{n}/rank_{r}" for r in range(size)]))
            except Exception:  # (the store failed: nothing known)
                return None
        if not 0 <= rank < len(claims):
            return None
        claim = _parse_claim(claims[rank])
        if claim is None or claim[2] is None:  # (a claim that does not say its pid space)
            return None
        return gone_here(claim[1], claim[2])

    return gone


def release_claim(store: Any) -> None:
    """Release the rank this process claimed on ``store`` by ``_checked_join`` (its group is
    destroyed; a process that comes for the rank next is not a second one). Never raises."""
    claim = getattr(store, "_rdzv_claim", None)
    if claim is None:
        return
    store._rdzv_claim = None
    key, me = claim
    with contextlib.suppress(Exception):
        store.compare_set(key, me, "released|" + me)


# -- the built-in handlers ---------------------------------------------------------------------
_AUTO_RANK = "tdist_rdzv/auto_rank"  # (file://: the count of ranks assigned automatically)


def _is_multicast(host: str | None) -> bool:
    import ipaddress

    try:
        return host is not None and ipaddress.ip_address(host).is_multicast
    except ValueError:  # (a host name)
        return False


def _file_rendezvous_handler(url: str, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    def _error(msg: str) -> ValueError:
        return _rendezvous_error("file:// rendezvous: " + msg)

    result = urlparse(url)
    if not result.path:
        hint = f"; write file:///absolute/path (three slashes), not {url!r}" if result.netloc else ""
        raise _error("path missing" + hint)
    if result.netloc not in ("", "localhost"):
        # torch would silently drop the host part ("file://tmp/x" is "/x"): say so instead
        raise _error(
            f"{url!r} names host {result.netloc!r}, but the file must be local; write "
            "file:///absolute/path (three slashes)"
        )
    query = _query_to_dict(result.query, "file")
    if "world_size" not in query:
        raise _error("world size parameter missing")
    world_size = _parse_int(query["world_size"], "world_size", "file")
    rank = _parse_int(query["rank"], "rank", "file") if "rank" in query else 0
    _check_rank(rank, world_size, "file")

    from ._file import FileStore

    store = FileStore(result.path, world_size)
    if "rank" not in query:
        # torch 0.3's automatic rank assignment ("Rank will be assigned automatically if
        # unspecified"): the processes take ranks in the order they reach the file
        rank = int(store.add(_AUTO_RANK, 1)) - 1
        if rank >= world_size:
            raise _error(
                f"rank parameter missing, and the {world_size} automatic ranks of {result.path} are "
                "taken; give every process a rank (rank=), or a new file for each job"
            )
    yield (store, rank, world_size)
    # If this configuration is invalidated, there is nothing we can do about it
    raise RuntimeError("Unable to perform rerendezvous using file:// method")


def _tcp_rendezvous_handler(
    url: str, timeout: timedelta = DEFAULT_RENDEZVOUS_TIMEOUT, **kwargs: Any
) -> Iterator[tuple[Store, int, int]]:
    def _error(msg: str) -> ValueError:
        return _rendezvous_error("tcp:// rendezvous: " + msg)

    result = urlparse(url)
    try:
        port = result.port
    except ValueError:  # out of range or not a number: say which
        raw = result.netloc.rpartition(":")[2]
        if raw.lstrip("-").isdigit():
            _check_port(int(raw))
        raise _error(f"port number {raw!r} in {url!r} is not a number from 0 to 65535") from None
    if port is None:
        raise _error("port number missing")
    if _is_multicast(result.hostname):
        raise _error(
            f"{result.hostname} is a multicast address: torch 0.3's multicast initialization "
            "(ranks assigned automatically) is not supported; give the address of rank 0's host, "
            "tcp://HOST:PORT, and every process its rank= and world_size= (or use file:// with "
            "world_size=, which assigns ranks)"
        )
    query = _query_to_dict(result.query, "tcp")
    if "rank" not in query:
        raise _error("rank parameter missing")
    if "world_size" not in query:
        raise _error("world size parameter missing")
    rank = _parse_int(query["rank"], "rank", "tcp")
    world_size = _parse_int(query["world_size"], "world_size", "tcp")
    _check_rank(rank, world_size, "tcp")
    if not result.hostname:
        raise _error(f"host name missing in {url!r}; write tcp://host:port")

    store = _create_c10d_store(result.hostname, port, rank, world_size, timeout, _use_libuv(query))
    yield (store, rank, world_size)
    # If this configuration is invalidated, there is nothing we can do about it
    raise RuntimeError("Unable to perform re-rendezvous using tcp:// method")


def _env_rendezvous_handler(
    url: str, timeout: timedelta = DEFAULT_RENDEZVOUS_TIMEOUT, **kwargs: Any
) -> Iterator[tuple[Store, int, int]]:
    def _error(msg: str) -> ValueError:
        return _rendezvous_error("env:// rendezvous: " + msg)

    def _get_env_or_raise(var: str) -> str:
        value = os.environ.get(var, None)
        if not value:
            raise _error(
                f"environment variable {var} expected, but not set "
                "(start the program with `tdist run` or torchrun, which set it, or set it yourself)"
            )
        return value

    result = urlparse(url)
    query = _query_to_dict(result.query, "env")
    if "rank" in query:
        rank = _parse_int(query["rank"], "rank", "env")
    else:
        rank = _parse_int(_get_env_or_raise("RANK"), "RANK", "env")
    if "world_size" in query:
        world_size = _parse_int(query["world_size"], "world_size", "env")
    else:
        world_size = _parse_int(_get_env_or_raise("WORLD_SIZE"), "WORLD_SIZE", "env")
    # rank 0 needs no MASTER_ADDR (as torch 0.3's env://: "required (except for rank 0)"): it
    # serves the store on every interface, as torch's own server does
    master_addr = os.environ.get("MASTER_ADDR") or ("0.0.0.0" if rank == 0 else _get_env_or_raise("MASTER_ADDR"))
    raw_port = _get_env_or_raise("MASTER_PORT")
    try:
        master_port = int(raw_port)
    except ValueError:
        raise _error(
            f"environment variable MASTER_PORT must be a port number, but was {raw_port!r}"
        ) from None
    _check_port(master_port)
    _check_rank(rank, world_size, "env")

    store = _create_c10d_store(master_addr, master_port, rank, world_size, timeout, _use_libuv(query))
    yield (store, rank, world_size)
    # If this configuration is invalidated, there is nothing we can do about it
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


register_rendezvous_handler("tcp", _tcp_rendezvous_handler)
register_rendezvous_handler("env", _env_rendezvous_handler)
register_rendezvous_handler("file", _file_rendezvous_handler)
