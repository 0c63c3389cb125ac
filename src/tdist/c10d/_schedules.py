"""Collective algorithms as pure schedules: who sends which chunk to whom, step by step.

Theory of operation
===================

A process-group engine runs a collective in three moves: it picks an algorithm
(``choose_algorithm``), asks this module for the calling rank's ``Schedule`` (a pure function of
``(rank, world_size, ...)``, so it can be cached), and executes the schedule over a transport.
Nothing here does I/O, threads or time; every algorithm is checked for every world size by
running all ranks' schedules through ``check_schedules`` and the reference executor in
``_simulate``.

Chunks
------
The data of a collective is cut into ``nchunks`` *chunks* named by integer ids. A chunk id names
the same piece of the logical data on every rank, so a sender and its receiver always agree on
what a transfer carries. Each rank holds a *workspace*: the chunks it currently has a value for.
``Schedule.inputs`` are the chunks a rank fills from its input before step 0; ``Schedule.outputs``
are the chunks it copies out after the last step. How chunk ids map to memory depends on the
collective (``n`` is the world size, ``chunk_bounds`` cuts a flat tensor)::

    collective      nchunks           chunk c is                     inputs        outputs
    all_reduce      n, 1 or H         chunk_bounds(numel, nchunks)   all           all
    reduce          1                 the same                       all           all (root)
    broadcast       1, or C (chain)   the same                       all (root)    all
    reduce_scatter  n                 rank c's block of the input    all           {rank}
    all_gather      n                 rank c's block of the output   {rank}        all
    barrier         0                 (no data: empty messages)      {}            {}

``all_reduce`` has ``n`` chunks with the ring, 1 with recursive doubling and one per host
(``H``) with the hierarchical algorithm. "(root)": only the root has these chunks; the other
ranks have none.

Where an algorithm cuts one buffer into chunks (ring, chain, hierarchical), the executor slices
with ``chunk_bounds(numel, schedule.nchunks)``, which handles uneven division and
``numel < nchunks`` (some chunks are empty).

Steps
-----
A ``Schedule`` is a tuple of ``Step``; a step is a set of ``Send(peer, chunks)`` and
``Recv(peer, chunks, action)`` that may run concurrently. A transfer carries its chunks in the
order listed (the payload is their concatenation; ids that follow each other in the layout are
contiguous memory and can travel as one buffer). ``Action.COPY`` overwrites the destination
chunks; ``Action.REDUCE`` combines the received values into them with the reduction op
(``dest = op(dest, received)``; every torch ``ReduceOp`` is commutative, so the order in which
contributions arrive does not matter). ``AVG`` runs as ``SUM`` and divides the outputs by ``n``
after the last step; ``PREMUL_SUM`` scales the inputs before step 0 and then runs as ``SUM``.

Execution model (what an executor must do):

1. Run the steps of a rank in order. Post every send and receive of step ``k`` together (for
   example non-blocking sends and receives); step ``k`` is complete when all of them are.
   Step ``k + 1`` starts only after step ``k`` is complete.
2. The sends of a step read the chunk values as they were when the step began. A receive whose
   chunks are also sent in the same step, and every ``REDUCE``, must therefore land in a staging
   buffer and be applied once the step's sends have read their data (recursive doubling sends
   and reduces the same chunks in one step; ring steps never overlap).
3. Messages between two ranks are matched in order: steps are *aligned*, so the i-th message from
   ``a`` to ``b`` belongs to the same step index on both sides. A rank has at most one send to
   and one receive from each peer per step, and the receives of a step never share a chunk.
4. Zero-byte transfers are real messages: the barrier is made of them. (An executor may skip a
   whole data collective whose ``numel`` is 0, since every rank knows it.)

Why no deadlock: ``check_schedules`` verifies that every send of step ``k`` has its receive in
step ``k`` of the peer and vice versa. By induction, if every rank completes steps ``< k``, every
rank posts all of step ``k``, each transfer finds its partner, and step ``k`` completes. This holds
even for rendezvous (unbuffered) sends, and a rank that runs ahead only waits.

Algorithms
----------
``n`` ranks, ``p`` the largest power of two ``<= n``, ``ceil_log2(n)`` the least ``k`` with
``2**k >= n``::

    algorithm                      steps                    notes
    ring_reduce_scatter            n - 1                    each rank sends (n-1)/n of the data
    ring_all_gather                n - 1
    ring_all_reduce                2 (n - 1)                bandwidth-optimal
    recursive_doubling_all_reduce  log2 p, +2 if n != p     latency-optimal; extra ranks fold in
    binomial_tree_*                ceil_log2(n)             broadcast/reduce
    chain_broadcast                C + n - 2                pipelined: C chunks along a chain
    dissemination_barrier          ceil_log2(n)             zero-byte messages
    hierarchical_all_reduce        2 ceil_log2(ranks per host) + the leaders' algorithm's steps

These are the schedules the ``tcp`` backend runs. ``choose_algorithm`` picks an ``all_reduce``'s
from the message size and the topology with an alpha-beta cost model (``CostModel``); see its
docstring for the rules and thresholds. The backend picks the others itself: a chain broadcast
for large buffers, a binomial tree otherwise; ``gather``, ``scatter`` and ``all_to_all`` send
straight to their peers, with no schedule.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from .._core.errors import DistError

__all__ = [
    "SHM_COLLECTIVES",
    "Action",
    "Algorithm",
    "Collective",
    "CostModel",
    "Recv",
    "Schedule",
    "ScheduleError",
    "Send",
    "Step",
    "Topology",
    "binomial_tree_broadcast",
    "binomial_tree_reduce",
    "ceil_log2",
    "chain_broadcast",
    "check_schedules",
    "choose_algorithm",
    "chunk_bounds",
    "dissemination_barrier",
    "hierarchical_all_reduce",
    "peers_of",
    "recursive_doubling_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
]


class ScheduleError(DistError, ValueError):
    """Bad arguments to a schedule builder, or schedules that are not mutually consistent."""


class Action(enum.Enum):
    """What a receive does with the data it gets."""

    COPY = "copy"
    """Overwrite the destination chunks."""
    REDUCE = "reduce"
    """Combine into the destination chunks with the reduction op."""


class Collective(enum.Enum):
    """The collective operations this module has schedules for."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    BARRIER = "barrier"


class Algorithm(enum.Enum):
    """Algorithm names. ``SHM`` is a marker: the shared-memory arena path, not a schedule."""

    RING = "ring"
    RECURSIVE_DOUBLING = "recursive_doubling"
    BINOMIAL_TREE = "binomial_tree"
    CHAIN = "chain"
    DISSEMINATION = "dissemination"
    HIERARCHICAL = "hierarchical"
    SHM = "shm"


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``chunks`` (in this order) to ``peer``."""

    peer: int
    chunks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive ``chunks`` (in this order) from ``peer`` and apply them with ``action``."""

    peer: int
    chunks: tuple[int, ...]
    action: Action = Action.COPY


@dataclass(frozen=True, slots=True)
class Step:
    """Transfers that may run concurrently; the sends read the values from before the step."""

    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()

    @property
    def is_empty(self) -> bool:
        """True when this rank does nothing in this step (it only keeps steps aligned)."""
        return not self.sends and not self.recvs


@dataclass(frozen=True, slots=True)
class Schedule:
    """One rank's part of a collective: its steps and the chunks it starts and ends with."""

    rank: int
    world_size: int
    collective: Collective
    algorithm: Algorithm
    nchunks: int
    steps: tuple[Step, ...]
    inputs: frozenset[int]
    outputs: frozenset[int]

    @property
    def num_steps(self) -> int:
        """Number of steps, empty ones included (every rank of a world has the same number)."""
        return len(self.steps)


# --------------------------------------------------------------------------------------------
# Helpers


def chunk_bounds(numel: int, nchunks: int) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into ``nchunks`` contiguous ``(start, stop)`` ranges.

    The first ``numel % nchunks`` chunks get one element more, as ``torch.tensor_split`` does;
    when ``numel < nchunks`` the trailing chunks are empty.

    Args:
        numel: number of elements, ``>= 0``.
        nchunks: number of chunks, ``>= 0`` (0 only with ``numel == 0``).

    Returns:
        ``nchunks`` ranges that cover ``[0, numel)`` in order.

    Raises:
        ScheduleError: on a negative argument, or ``nchunks == 0`` with elements to place.
    """
    if numel < 0 or nchunks < 0:
        raise ScheduleError(f"chunk_bounds: numel={numel} and nchunks={nchunks} must be >= 0")
    if nchunks == 0:
        if numel:
            raise ScheduleError(f"chunk_bounds: cannot cut numel={numel} into 0 chunks")
        return []
    base, extra = divmod(numel, nchunks)
    bounds: list[tuple[int, int]] = []
    start = 0
    for c in range(nchunks):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ceil_log2(n: int) -> int:
    """Smallest ``k`` with ``2**k >= n`` (0 for ``n <= 1``): rounds of a binomial tree."""
    return (n - 1).bit_length() if n > 1 else 0


def peers_of(schedule: Schedule) -> frozenset[int]:
    """The ranks this rank sends to or receives from (to open connections lazily).

    Args:
        schedule: one rank's schedule.

    Returns:
        The set of peer ranks, never including ``schedule.rank``.
    """
    peers: set[int] = set()
    for step in schedule.steps:
        peers.update(s.peer for s in step.sends)
        peers.update(r.peer for r in step.recvs)
    return frozenset(peers)


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ScheduleError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ScheduleError(f"rank={rank} is not in [0, {world_size})")


def _check_root(root: int, world_size: int) -> None:
    if not 0 <= root < world_size:
        raise ScheduleError(f"root={root} is not in [0, {world_size})")


class _Steps:
    """Accumulates one rank's transfers per step index; every rank of a phase uses the same
    number of steps, so that steps stay aligned across ranks."""

    def __init__(self, nsteps: int) -> None:
        self._sends: list[list[Send]] = [[] for _ in range(nsteps)]
        self._recvs: list[list[Recv]] = [[] for _ in range(nsteps)]

    def send(self, step: int, peer: int, chunks: Iterable[int]) -> None:
        self._sends[step].append(Send(peer, tuple(chunks)))

    def recv(self, step: int, peer: int, chunks: Iterable[int], action: Action) -> None:
        self._recvs[step].append(Recv(peer, tuple(chunks), action))

    def build(self) -> list[Step]:
        return [Step(tuple(s), tuple(r)) for s, r in zip(self._sends, self._recvs, strict=True)]


def _schedule(
    rank: int,
    world_size: int,
    collective: Collective,
    algorithm: Algorithm,
    nchunks: int,
    steps: Iterable[Step],
    inputs: Iterable[int],
    outputs: Iterable[int],
) -> Schedule:
    return Schedule(
        rank=rank,
        world_size=world_size,
        collective=collective,
        algorithm=algorithm,
        nchunks=nchunks,
        steps=tuple(steps),
        inputs=frozenset(inputs),
        outputs=frozenset(outputs),
    )


# --------------------------------------------------------------------------------------------
# Building blocks over a group of members.
#
# Each builder returns the steps of the member at ``index`` of ``members`` (global ranks, in the
# group's order); peers in the steps are global ranks. The public functions below use
# ``members = range(world_size)``; ``hierarchical_all_reduce`` uses host groups and leaders.


def _ring_reduce_scatter_steps(index: int, members: Sequence[int]) -> list[Step]:
    # Chunk j belongs to member j. At step k member i passes on the partial sum of chunk
    # i-k-1 and folds its own data into chunk i-k-2; after n-1 steps it holds chunk i.
    n = len(members)
    out = _Steps(n - 1)
    nxt, prv = members[(index + 1) % n], members[(index - 1) % n]
    for k in range(n - 1):
        out.send(k, nxt, ((index - k - 1) % n,))
        out.recv(k, prv, ((index - k - 2) % n,), Action.REDUCE)
    return out.build()


def _ring_all_gather_steps(index: int, members: Sequence[int]) -> list[Step]:
    n = len(members)
    out = _Steps(n - 1)
    nxt, prv = members[(index + 1) % n], members[(index - 1) % n]
    for k in range(n - 1):
        out.send(k, nxt, ((index - k) % n,))
        out.recv(k, prv, ((index - k - 1) % n,), Action.COPY)
    return out.build()


def _recursive_doubling_num_steps(n: int) -> int:
    if n <= 1:
        return 0
    p = 1 << (n.bit_length() - 1)
    return p.bit_length() - 1 + (2 if n != p else 0)


def _recursive_doubling_steps(
    index: int, members: Sequence[int], chunks: tuple[int, ...]
) -> list[Step]:
    # MPICH's scheme: with n = p + rem, the first 2*rem members pair up (even folds into the
    # odd one next to it, which is more likely on the same host), p members run log2(p) rounds
    # of pairwise exchange, and the odd members finally hand the result back.
    n = len(members)
    nsteps = _recursive_doubling_num_steps(n)
    out = _Steps(nsteps)
    if n == 1:
        return out.build()
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    first = 1 if rem else 0
    if index < 2 * rem:
        if index % 2 == 0:
            out.send(0, members[index + 1], chunks)
            out.recv(nsteps - 1, members[index + 1], chunks, Action.COPY)
            return out.build()
        out.recv(0, members[index - 1], chunks, Action.REDUCE)
        out.send(nsteps - 1, members[index - 1], chunks)
        virtual = index // 2
    else:
        virtual = index - rem
    for j in range(p.bit_length() - 1):
        pv = virtual ^ (1 << j)
        partner = members[2 * pv + 1 if pv < rem else pv + rem]
        out.send(first + j, partner, chunks)
        out.recv(first + j, partner, chunks, Action.REDUCE)
    return out.build()


def _tree_down_steps(index: int, members: Sequence[int], root: int, chunks: tuple[int, ...]) -> list[Step]:
    # Broadcast: every transfer carries ``chunks``.
    # Virtual rank v = (index - root) % n; the parent of v is v minus its lowest set bit and v's
    # subtree is [v, v + lowbit(v)). Rounds go from the largest mask down, so the root first
    # hands off the biggest subtree.
    n = len(members)
    rounds = ceil_log2(n)
    out = _Steps(rounds)
    v = (index - root) % n

    def member(virtual: int) -> int:
        return members[(virtual + root) % n]

    for j in range(rounds):
        mask = 1 << (rounds - 1 - j)
        if v % (2 * mask) == 0 and v + mask < n:
            out.send(j, member(v + mask), chunks)
        elif v % (2 * mask) == mask:
            out.recv(j, member(v - mask), chunks, Action.COPY)
    return out.build()


def _tree_up_steps(index: int, members: Sequence[int], root: int, chunks: tuple[int, ...]) -> list[Step]:
    # Reduce: every transfer carries ``chunks``, REDUCEd into them. The same tree as
    # ``_tree_down_steps``, walked leaves first.
    n = len(members)
    rounds = ceil_log2(n)
    out = _Steps(rounds)
    v = (index - root) % n

    def member(virtual: int) -> int:
        return members[(virtual + root) % n]

    for j in range(rounds):
        mask = 1 << j
        if v % (2 * mask) == mask:
            out.send(j, member(v - mask), chunks)
        elif v % (2 * mask) == 0 and v + mask < n:
            out.recv(j, member(v + mask), chunks, Action.REDUCE)
    return out.build()


# --------------------------------------------------------------------------------------------
# Public schedules


def ring_reduce_scatter(rank: int, world_size: int) -> Schedule:
    """Ring reduce-scatter: rank ``r`` ends with the reduction of chunk ``r``.

    ``nchunks == world_size``; ``n - 1`` steps, each a send to ``rank + 1`` and a ``REDUCE``
    receive from ``rank - 1`` of one chunk.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank or world size.
    """
    _check_world(rank, world_size)
    members = range(world_size)
    return _schedule(
        rank,
        world_size,
        Collective.REDUCE_SCATTER,
        Algorithm.RING,
        world_size,
        _ring_reduce_scatter_steps(rank, members),
        members,
        (rank,),
    )


def ring_all_gather(rank: int, world_size: int) -> Schedule:
    """Ring all-gather: rank ``r`` starts with chunk ``r`` and ends with every chunk.

    ``nchunks == world_size``; ``n - 1`` steps, each a send to ``rank + 1`` and a ``COPY``
    receive from ``rank - 1`` of one chunk.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank or world size.
    """
    _check_world(rank, world_size)
    members = range(world_size)
    return _schedule(
        rank,
        world_size,
        Collective.ALL_GATHER,
        Algorithm.RING,
        world_size,
        _ring_all_gather_steps(rank, members),
        (rank,),
        members,
    )


def ring_all_reduce(rank: int, world_size: int) -> Schedule:
    """Ring all-reduce: a ring reduce-scatter then a ring all-gather, ``2 (n - 1)`` steps.

    Bandwidth-optimal: each rank sends and receives ``2 (n - 1) / n`` of the buffer. The buffer
    is cut into ``world_size`` chunks with ``chunk_bounds``.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank or world size.
    """
    _check_world(rank, world_size)
    members = range(world_size)
    steps = _ring_reduce_scatter_steps(rank, members) + _ring_all_gather_steps(rank, members)
    return _schedule(
        rank, world_size, Collective.ALL_REDUCE, Algorithm.RING, world_size, steps, members, members
    )


def recursive_doubling_all_reduce(rank: int, world_size: int) -> Schedule:
    """Recursive-doubling all-reduce: ``log2 p`` exchanges of the whole buffer.

    Latency-optimal for small messages. With ``p`` the largest power of two ``<= n`` and
    ``rem = n - p``, ranks ``0, 2, ..., 2 rem - 2`` first send their buffer to the next rank
    (which reduces it), sit out the exchanges, and get the result back in a last step:
    ``log2 p + 2`` steps when ``n`` is not a power of two. ``nchunks == 1``.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank or world size.
    """
    _check_world(rank, world_size)
    steps = _recursive_doubling_steps(rank, range(world_size), (0,))
    return _schedule(
        rank, world_size, Collective.ALL_REDUCE, Algorithm.RECURSIVE_DOUBLING, 1, steps, (0,), (0,)
    )


def binomial_tree_broadcast(rank: int, world_size: int, root: int = 0) -> Schedule:
    """Binomial-tree broadcast of ``root``'s buffer, ``ceil_log2(n)`` steps, ``nchunks == 1``.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.
        root: the rank whose buffer everyone gets.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank, root or world size.
    """
    _check_world(rank, world_size)
    _check_root(root, world_size)
    steps = _tree_down_steps(rank, range(world_size), root, (0,))
    return _schedule(
        rank,
        world_size,
        Collective.BROADCAST,
        Algorithm.BINOMIAL_TREE,
        1,
        steps,
        (0,) if rank == root else (),
        (0,),
    )


def binomial_tree_reduce(rank: int, world_size: int, root: int = 0) -> Schedule:
    """Binomial-tree reduce to ``root``, ``ceil_log2(n)`` steps, ``nchunks == 1``.

    Only the root's output is defined; the other ranks' buffers hold partial results.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.
        root: the rank that gets the reduction.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank, root or world size.
    """
    _check_world(rank, world_size)
    _check_root(root, world_size)
    steps = _tree_up_steps(rank, range(world_size), root, (0,))
    return _schedule(
        rank,
        world_size,
        Collective.REDUCE,
        Algorithm.BINOMIAL_TREE,
        1,
        steps,
        (0,),
        (0,) if rank == root else (),
    )


def chain_broadcast(rank: int, world_size: int, root: int = 0, nchunks: int = 1) -> Schedule:
    """Pipelined chain broadcast for large messages: ``nchunks + n - 2`` steps (``n >= 2``).

    Ranks form a chain ``root, root + 1, ...`` (mod ``n``); at step ``t`` the rank at distance
    ``d`` from the root forwards chunk ``t - d`` while it receives chunk ``t - d + 1``, so all
    links carry data at once. Each rank sends about the buffer once; the caller picks ``nchunks``
    (the ``tcp`` backend: one per MiB, from 2 to 64).

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.
        root: the rank whose buffer everyone gets.
        nchunks: pieces the buffer is cut into (``chunk_bounds``), ``>= 1``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank, root, world size or ``nchunks``.
    """
    _check_world(rank, world_size)
    _check_root(root, world_size)
    if nchunks < 1:
        raise ScheduleError(f"chain_broadcast: nchunks={nchunks} must be >= 1")
    n = world_size
    d = (rank - root) % n
    out = _Steps(nchunks + n - 2 if n > 1 else 0)
    for t in range(nchunks + n - 2 if n > 1 else 0):
        if d < n - 1 and 0 <= t - d < nchunks:
            out.send(t, (rank + 1) % n, (t - d,))
        if d > 0 and 0 <= t - d + 1 < nchunks:
            out.recv(t, (rank - 1) % n, (t - d + 1,), Action.COPY)
    chunks = range(nchunks)
    return _schedule(
        rank,
        n,
        Collective.BROADCAST,
        Algorithm.CHAIN,
        nchunks,
        out.build(),
        chunks if rank == root else (),
        chunks,
    )


def dissemination_barrier(rank: int, world_size: int) -> Schedule:
    """Dissemination barrier: in round ``j`` send to ``rank + 2**j``, receive from ``rank - 2**j``.

    ``ceil_log2(n)`` rounds of zero-byte messages (``nchunks == 0``); after the last one every
    rank has heard, directly or not, from every other.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank or world size.
    """
    _check_world(rank, world_size)
    n = world_size
    rounds = ceil_log2(n)
    out = _Steps(rounds)
    for j in range(rounds):
        out.send(j, (rank + (1 << j)) % n, ())
        out.recv(j, (rank - (1 << j)) % n, (), Action.COPY)
    return _schedule(rank, n, Collective.BARRIER, Algorithm.DISSEMINATION, 0, out.build(), (), ())


def hierarchical_all_reduce(
    rank: int,
    world_size: int,
    hosts: Sequence[Hashable],
    inter: Algorithm = Algorithm.RING,
) -> Schedule:
    """Two-level all-reduce: reduce on each host, all-reduce among hosts, broadcast on each host.

    Ranks with equal ``hosts[r]`` share a host; the lowest rank of a host is its leader and
    hosts are ordered by their leaders. Phase 1 is a binomial-tree reduce to the leader, phase 2
    an all-reduce among leaders (``inter``: ``RING``, with ``nchunks`` = number of hosts, or
    ``RECURSIVE_DOUBLING``, with ``nchunks == 1``), phase 3 a binomial-tree broadcast from the
    leader. Every phase is padded to its longest member, so steps stay aligned: the schedule has
    ``2 ceil_log2(max ranks per host)`` plus the inter-host algorithm's steps. Only leaders
    cross hosts, each sending about ``2 (H - 1) / H`` of the buffer with ``RING``.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, ``>= 1``.
        hosts: the host id of every rank, ``len(hosts) == world_size``.
        inter: the leaders' algorithm, ``Algorithm.RING`` or ``Algorithm.RECURSIVE_DOUBLING``.

    Returns:
        The schedule of ``rank``.

    Raises:
        ScheduleError: on an invalid rank, world size, ``hosts`` or ``inter``.
    """
    _check_world(rank, world_size)
    if len(hosts) != world_size:
        raise ScheduleError(
            f"hierarchical_all_reduce: {len(hosts)} host ids for world_size={world_size}"
        )
    if inter not in (Algorithm.RING, Algorithm.RECURSIVE_DOUBLING):
        raise ScheduleError(
            f"hierarchical_all_reduce: inter={inter} must be RING or RECURSIVE_DOUBLING"
        )
    groups = _host_groups(hosts)
    leaders = [g[0] for g in groups]
    nhosts = len(groups)
    mine = next(g for g in groups if rank in g)
    index = mine.index(rank)
    nchunks = nhosts if inter is Algorithm.RING else 1
    chunks = tuple(range(nchunks))
    local_rounds = max(ceil_log2(len(g)) for g in groups)

    def padded(steps: list[Step], length: int) -> list[Step]:
        return steps + [Step()] * (length - len(steps))

    if inter is Algorithm.RING:
        inter_len = 2 * (nhosts - 1)
    else:
        inter_len = _recursive_doubling_num_steps(nhosts)
    if index == 0:
        li = leaders.index(rank)
        if inter is Algorithm.RING:
            middle = _ring_reduce_scatter_steps(li, leaders) + _ring_all_gather_steps(li, leaders)
        else:
            middle = _recursive_doubling_steps(li, leaders, chunks)
    else:
        middle = []
    steps = (
        padded(_tree_up_steps(index, mine, 0, chunks), local_rounds)
        + padded(middle, inter_len)
        + padded(_tree_down_steps(index, mine, 0, chunks), local_rounds)
    )
    return _schedule(
        rank,
        world_size,
        Collective.ALL_REDUCE,
        Algorithm.HIERARCHICAL,
        nchunks,
        steps,
        chunks,
        chunks,
    )


def _host_groups(hosts: Sequence[Hashable]) -> list[list[int]]:
    """Ranks grouped by host id, each group ascending, groups ordered by their lowest rank."""
    groups: dict[Hashable, list[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    return list(groups.values())


# --------------------------------------------------------------------------------------------
# Validation


def check_schedules(schedules: Sequence[Schedule]) -> None:
    """Check that the schedules of a whole world fit together; raise on the first problem.

    Checks, for ``schedules[r]`` the schedule of rank ``r``:

    * all agree on world size, collective, algorithm and ``nchunks``;
    * every transfer names a valid peer other than itself and valid chunk ids, without
      repeats; a step has at most one send to and one receive from each peer, and its
      receives share no chunk;
    * matching: every send in step ``k`` has a receive of the same chunks (same order) in step
      ``k`` of the peer, and every receive a send. With the execution model of the module
      docstring this also proves the world cannot deadlock;
    * data flow: a rank only sends chunks it holds (inputs, or received earlier), only
      ``REDUCE``\\ s into chunks it holds, and holds all its outputs at the end.

    Whether the values are right (each contribution reduced exactly once) is the simulator's
    job (``tdist.c10d._simulate``).

    Args:
        schedules: one schedule per rank, in rank order.

    Raises:
        ScheduleError: naming the rank, the step, the peer and the chunks that do not fit.
    """
    n = len(schedules)
    if n == 0:
        raise ScheduleError("check_schedules: no schedules")
    first = schedules[0]
    what = f"{first.collective.value}/{first.algorithm.value}"
    for r, s in enumerate(schedules):
        if s.rank != r or s.world_size != n:
            raise ScheduleError(
                f"{what}: schedules[{r}] is for rank {s.rank} of "
                f"{s.world_size}, expected rank {r} of {n}"
            )
        if (s.collective, s.algorithm, s.nchunks) != (
            first.collective,
            first.algorithm,
            first.nchunks,
        ):
            raise ScheduleError(
                f"{what}: rank {r} runs {s.collective.value}/"
                f"{s.algorithm.value} with nchunks={s.nchunks}, rank 0 "
                f"nchunks={first.nchunks}"
            )
        _check_local(s, what)

    nsteps = max(s.num_steps for s in schedules)

    def step_of(r: int, k: int) -> Step:
        steps = schedules[r].steps
        return steps[k] if k < len(steps) else Step()

    for k in range(nsteps):
        for r in range(n):
            step = step_of(r, k)
            for snd in step.sends:
                match = [rv for rv in step_of(snd.peer, k).recvs if rv.peer == r]
                if not match:
                    raise ScheduleError(
                        f"{what}: rank {r} step {k} sends chunks {snd.chunks} "
                        f"to rank {snd.peer}, which receives nothing from rank "
                        f"{r} in step {k} (deadlock)"
                    )
                if match[0].chunks != snd.chunks:
                    raise ScheduleError(
                        f"{what}: rank {r} step {k} sends chunks {snd.chunks} "
                        f"to rank {snd.peer}, which expects {match[0].chunks}"
                    )
            for rcv in step.recvs:
                if not any(sd.peer == r for sd in step_of(rcv.peer, k).sends):
                    raise ScheduleError(
                        f"{what}: rank {r} step {k} receives chunks "
                        f"{rcv.chunks} from rank {rcv.peer}, which sends "
                        f"nothing to rank {r} in step {k} (deadlock)"
                    )

    held = [set(s.inputs) for s in schedules]
    for k in range(nsteps):
        for r in range(n):
            step = step_of(r, k)
            for snd in step.sends:
                missing = set(snd.chunks) - held[r]
                if missing:
                    raise ScheduleError(
                        f"{what}: rank {r} step {k} sends chunks "
                        f"{sorted(missing)} to rank {snd.peer} before it holds "
                        f"them"
                    )
            for rcv in step.recvs:
                missing = set(rcv.chunks) - held[r]
                if rcv.action is Action.REDUCE and missing:
                    raise ScheduleError(
                        f"{what}: rank {r} step {k} reduces chunks "
                        f"{sorted(missing)} from rank {rcv.peer} into chunks it "
                        f"does not hold"
                    )
        for r in range(n):
            for rcv in step_of(r, k).recvs:
                held[r].update(rcv.chunks)
    for r, s in enumerate(schedules):
        missing = set(s.outputs) - held[r]
        if missing:
            raise ScheduleError(
                f"{what}: rank {r} ends without its output chunks {sorted(missing)}"
            )


def _check_local(s: Schedule, what: str) -> None:
    n, r = s.world_size, s.rank
    for ids, name in ((s.inputs, "inputs"), (s.outputs, "outputs")):
        if any(not 0 <= c < s.nchunks for c in ids):
            raise ScheduleError(f"{what}: rank {r} {name} {sorted(ids)} out of [0, {s.nchunks})")
    for k, step in enumerate(s.steps):
        transfers: list[tuple[str, int, tuple[int, ...]]] = [
            ("send", t.peer, t.chunks) for t in step.sends
        ] + [("recv", t.peer, t.chunks) for t in step.recvs]
        for kind, peer, chunks in transfers:
            if not 0 <= peer < n or peer == r:
                raise ScheduleError(f"{what}: rank {r} step {k} has a {kind} with peer {peer}")
            if len(set(chunks)) != len(chunks) or any(not 0 <= c < s.nchunks for c in chunks):
                raise ScheduleError(
                    f"{what}: rank {r} step {k} {kind} with rank {peer} has "
                    f"bad chunk ids {chunks} (nchunks={s.nchunks})"
                )
        for kind, peers in (
            ("send to", [t.peer for t in step.sends]),
            ("receive from", [t.peer for t in step.recvs]),
        ):
            if len(set(peers)) != len(peers):
                raise ScheduleError(
                    f"{what}: rank {r} step {k} has more than one {kind} the same peer: {peers}"
                )
        seen: set[int] = set()
        for rcv in step.recvs:
            if seen & set(rcv.chunks):
                raise ScheduleError(
                    f"{what}: rank {r} step {k} receives chunks "
                    f"{sorted(seen & set(rcv.chunks))} twice"
                )
            seen.update(rcv.chunks)


# --------------------------------------------------------------------------------------------
# Choosing an algorithm


@dataclass(frozen=True, slots=True)
class Topology:
    """Where the ranks of a group run: ``hosts[r]`` is the host id of rank ``r``.

    ``shm`` says whether the shared-memory arena may be used when all ranks share a host.
    """

    hosts: tuple[Hashable, ...]
    shm: bool = True

    @classmethod
    def one_host(cls, world_size: int, shm: bool = True) -> Topology:
        """All ``world_size`` ranks on one host."""
        return cls(("localhost",) * world_size, shm)

    @classmethod
    def from_hosts(cls, hosts: Iterable[Hashable], shm: bool = True) -> Topology:
        """From the host id of every rank (a hostname, an IP, any hashable)."""
        return cls(tuple(hosts), shm)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        """Number of distinct hosts."""
        return len(set(self.hosts))

    @property
    def max_ranks_per_host(self) -> int:
        """Largest number of ranks on one host (0 for an empty topology)."""
        return max((len(g) for g in _host_groups(self.hosts)), default=0)


SHM_COLLECTIVES: frozenset[Collective] = frozenset(Collective)
"""Collectives that the shared-memory arena implements (narrow it if the arena does less)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Alpha-beta model: a step that moves ``b`` bytes costs ``latency_s + b / bytes_per_s``.

    The defaults are this project's measurements: a hand-off between Python processes costs
    20-80 us (taken as 50 us), loopback TCP moves about 2.5 GB/s. Only the ratio
    ``latency_s * bytes_per_s`` (125 KB) matters to the choices.
    """

    latency_s: float = 50e-6
    bytes_per_s: float = 2.5e9
    # Element-wise reduction speed; 0 leaves reductions out of the model (the default, for
    # which the crossovers above are documented). A CPU-bound machine should set it: recursive
    # doubling reduces the whole buffer at every step, the ring only 1/n of it.
    reduce_bytes_per_s: float = 0.0

    def reduce(self, nbytes: float) -> float:
        """Seconds to reduce ``nbytes`` into a buffer (0 when reductions are not modelled)."""
        return nbytes / self.reduce_bytes_per_s if self.reduce_bytes_per_s > 0 else 0.0

    def step(self, nbytes: float) -> float:
        """Seconds for one step that moves ``nbytes``."""
        return self.latency_s + nbytes / self.bytes_per_s

    def estimate(
        self, collective: Collective, algorithm: Algorithm, nbytes: int, world_size: int
    ) -> float:
        """Seconds on the critical path for one rank's buffer of ``nbytes`` bytes (the
        ``all_reduce`` algorithms ``choose_algorithm`` weighs: ``RING``, ``RECURSIVE_DOUBLING``).

        Raises:
            ScheduleError: for a pair this model does not cover.
        """
        n = world_size
        if n <= 1:
            return 0.0
        key = (collective, algorithm)
        if key == (Collective.ALL_REDUCE, Algorithm.RING):
            return 2 * (n - 1) * self.step(nbytes / n) + (n - 1) * self.reduce(nbytes / n)
        if key == (Collective.ALL_REDUCE, Algorithm.RECURSIVE_DOUBLING):
            steps = _recursive_doubling_num_steps(n)
            return steps * self.step(nbytes) + steps * self.reduce(nbytes)
        raise ScheduleError(
            f"CostModel has no estimate for {collective.value} with {algorithm.value}"
        )


def choose_algorithm(
    collective: Collective,
    nbytes: int,
    world_size: int,
    topology: Topology | None = None,
    *,
    cost: CostModel | None = None,
    shm_collectives: frozenset[Collective] = SHM_COLLECTIVES,
) -> Algorithm:
    """Pick the algorithm of one ``all_reduce`` call (the one collective whose algorithm the
    ``tcp`` backend chooses; it runs the others with fixed schedules or direct sends).

    Rules, in order:

    1. All ranks on one host (``topology.num_hosts == 1``, ``topology.shm``, ``n > 1``) and the
       arena implements the collective: ``SHM``. A shared-memory poll costs under 1 us against
       about 21 us for a Unix-socket round trip, and data is copied about twice per byte, so the
       arena wins at every size.
    2. ``all_reduce`` over several hosts with more than one rank on some host: ``HIERARCHICAL``
       (only leaders cross hosts). Its leaders' algorithm is chosen by calling this function
       again with ``world_size`` = number of hosts and no topology.
    3. ``all_reduce``: ``RECURSIVE_DOUBLING`` when the cost model says it is cheaper than
       ``RING``, else ``RING``. Recursive doubling takes ``log2 n`` steps of the whole buffer,
       the ring ``2 (n - 1)`` steps of ``1/n`` of it. With the default model the ring takes
       over above ``nbytes`` of about 1.0 MB at n = 4, 1.1 MB at n = 8, 1.5 MB at n = 16 and,
       since recursive doubling pays two extra whole-buffer steps to fold in the ranks beyond
       a power of two, 75 KB at n = 3, 210 KB at n = 5, 790 KB at n = 17. With n = 2 recursive
       doubling always wins (one exchange instead of two half ones).

    Ties go to the algorithm with fewer steps.

    Args:
        collective: the collective.
        nbytes: bytes of one rank's full buffer (the all-reduce tensor).
        world_size: ranks in the group.
        topology: where the ranks run; ``None`` means unknown (no ``SHM``, no hierarchy).
        cost: the cost model (default ``CostModel()``).
        shm_collectives: collectives the shared-memory arena implements.

    Returns:
        The algorithm: ``SHM``, ``HIERARCHICAL`` (``hierarchical_all_reduce``),
        ``RECURSIVE_DOUBLING`` or ``RING``.

    Raises:
        ScheduleError: if ``topology`` does not describe ``world_size`` ranks, or (outside the
            arena) for a collective other than ``all_reduce``.
    """
    if world_size < 1:
        raise ScheduleError(f"world_size={world_size} must be >= 1")
    if topology is not None and topology.world_size != world_size:
        raise ScheduleError(f"topology has {topology.world_size} ranks, world_size={world_size}")
    cost = cost or CostModel()
    if (
        topology is not None
        and world_size > 1
        and topology.shm
        and topology.num_hosts == 1
        and collective in shm_collectives
    ):
        return Algorithm.SHM
    if collective is Collective.ALL_REDUCE:
        if topology is not None and topology.num_hosts > 1 and topology.max_ranks_per_host > 1:
            return Algorithm.HIERARCHICAL
        rd = cost.estimate(collective, Algorithm.RECURSIVE_DOUBLING, nbytes, world_size)
        ring = cost.estimate(collective, Algorithm.RING, nbytes, world_size)
        return Algorithm.RECURSIVE_DOUBLING if rd <= ring else Algorithm.RING
    raise ScheduleError(
        f"choose_algorithm picks all_reduce's algorithm only, not {collective.value}'s: the tcp "
        "backend runs the other collectives with fixed schedules"
    )
