"""RRef reference counting, sans-IO: torch's Remote Reference Protocol as a state machine.

Theory of operation
===================

An RRef is a distributed shared pointer. Its value lives on one worker, the *owner*; every other
worker that holds it holds a *user* reference. Identity is two globally unique ids, each a
``GloballyUniqueId(created_on, local_id)`` made by one worker's counter: the ``RRefId`` names
the value, a ``ForkId`` names one user reference (one unpickled copy). The owner keeps, per
RRef, the set of forks it knows and how many local Python objects refer to its value; it drops
the record (``DeleteOwner``: the agent frees the value) when both are gone. One
``RRefProtocol`` per worker holds that state. It is pure: calls and messages in, ``Action``\\ s
out. It does no I/O, takes no locks and reads no clock; the agent serializes every call (one
lock), performs the actions, and tells it when Python objects die.

The danger is deleting the value while a reference to it is still travelling or unknown to the
owner. Two guarantees (torch's) prevent it:

- **G1** every user tells the owner when it is deleted (``UserDelete``);
- **G2** a user that forked a child keeps itself alive (a *pending child*) until the child is
  confirmed by the owner (``ChildAccept``).

So a user's ``UserDelete`` goes out only when it is released locally, confirmed by the owner, and
has no pending children, whichever of the three happens last. The fork graph is a tree; by G2
every fork the owner does not know yet has an ancestor the owner knows and that is still alive
(or the tree's root is the creator of a ``remote()`` whose request has not arrived, and then the
owner has no value to delete). Hence the owner's count never reaches zero early, whatever order
messages arrive in. Nothing here relies on per-connection FIFO order: every message that could
do harm is sent only after the message it depends on was *processed* (causal order).

Message flows (``R`` an RRefId, ``F`` a ForkId, ``fork@W``: a fork the owner knows, held by W)::

    1. remote(): creator C, owner O
       C: create_user_for_remote(O) -> (R, F=R)   user F unconfirmed
       C ---- remote(R, F, fn) ----------------> O: owner_created_by_remote(R, F, C)
                                                    forks {F@C}; runs fn, keeps the value
       C <--- reply ---------------------------- O
       C: confirm(F)          ... later user_released(F)
       C ---- UserDelete(R, F) ----------------> O: forks {} -> DeleteOwner(R)

    2. the owner O shares with user U
       O: fork_for(R, None, O, U) -> F           forks += {F@U} at once
       O ---- (R, F, owner=O, parent=O) -------> U: received(): user F confirmed at once
       O <--- UserDelete(R, F) ----------------- U: (on release)

    3. user A shares with the owner O
       A: fork_for(R, Fa, O, O) -> Fx            Fx is a pending child of Fa
       A ---- (R, Fx, owner=O, parent=A) ------> O: received(): one more local reference
       A <--- ChildAccept(R, Fx) --------------- O
       A: pending child Fx dropped (Fa may now be deleted)

    4. user A shares with user B
       A: fork_for(R, Fa, O, B) -> Fb            Fb is a pending child of Fa
       A ---- (R, Fb, owner=O, parent=A) ------> B: received(): user Fb unconfirmed
                                                 B ---- ForkRequest(R, Fb, A) -----> O
                                                                forks += {Fb@B}
                                                 B <--- ForkAccept(R, Fb) --------- O
                                                 B: Confirmed(Fb)
       A <--- ChildAccept(R, Fb) --------------- B
       A: pending child Fb dropped

An owner sending its own RRef to itself registers a fork held by itself, which becomes a local
reference when it is received (as torch does: with no fork, the sender's object could die and
delete the value before the message is read). A user sending to itself goes through flow 4 with
``B == A``; messages to oneself are handled inline, never returned as ``Send``.

**Pending owners.** A ``ForkRequest`` from a grandchild, or a user's RRef sent to the owner, can
overtake the creator's ``remote()`` request on another connection. The owner then creates its
record eagerly in state ``OwnerState.PENDING`` (no value yet); ``owner_created_by_remote``
makes it ``LIVE``. Only a ``LIVE`` record ever emits ``DeleteOwner``; a pending record with no
forks and no local references is dropped silently (it carries nothing the ``remote()`` request
will not bring again). ``DeleteOwner`` is emitted at most once per record.

**Failures.** ``peer_failed(W)`` is called once every message from W has been handed in.
Pending children sent to W are forgotten (their parents may delete). The owner drops the forks
W held. Users of RRefs owned by W are marked lost (``RRefLost``: the agent fails their
``to_here``) and vanish quietly when released; those W never confirmed send ``ChildAccept`` to
their parent at once (as does a user received when its owner is known dead), so a pending
child always ends with exactly one ``ChildAccept`` or with the child's death. Pending owners
created by W become ``ABANDONED`` (their ``remote()`` will never come; ``RRefLost`` too). A
record the owner creates for an unknown RRef whose creator or forking parent is dead, or that
this worker created itself (so it was deleted already), starts ``ABANDONED``; a ``remote()``
request that arrives after all makes it ``LIVE``. Sends to dead workers are left out. After a
failure a user may hold an RRef whose value is gone: its ``to_here`` fails, nothing hangs on
the reference count, and releasing it cleans up. One case stays slow: an unknown RRef reached
through a chain that crossed a dead worker, whose creator is alive, is taken as pending, so a
``to_here`` on it waits for the agent's RPC timeout.

**Errors.** Input from the network (``handle``, ``received``, ``confirm``) never raises: a
message for an unknown fork, a duplicate, or one from the wrong worker leaves the state untouched
and returns a ``ProtocolWarning`` action for the agent to log. Misuse by the local agent
(releasing twice, forking a released reference, an id that does not exist) raises
``LocalProtocolError``; forking towards a worker known dead raises ``PeerError``. Neither
changes the state.

**Agent contract.** Call ``owner_created_by_remote`` when a ``remote()`` request arrives, before
running the function (also when running it fails: the error is the value). Call ``confirm`` when
the reply to a ``remote()`` arrives, whatever it holds. Call ``fork_for`` for every RRef pickled
into a message, and ``fork_not_sent`` for each if that message is then not sent. Call
``received`` for every RRef unpickled from a message; each ``received`` on the owner, and each
``create_owner_local``, counts one local reference, to be ended by one ``owner_released``. Call
``user_released`` once per user fork when its last Python object dies. Perform the returned
actions in order; ``Send``\\ s need not stay in order. Not thread-safe: hold one lock around
every call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

from .._core.errors import LocalProtocolError, PeerError

__all__ = [
    "Action",
    "ChildAccept",
    "Confirmed",
    "DeleteOwner",
    "ForkAccept",
    "ForkDecision",
    "ForkId",
    "ForkRequest",
    "GloballyUniqueId",
    "LeakInfo",
    "Message",
    "OwnerState",
    "ProtocolWarning",
    "RRefId",
    "RRefLost",
    "RRefProtocol",
    "Send",
    "UserDelete",
    "UserInfo",
]


class GloballyUniqueId(NamedTuple):
    """``(created_on, local_id)``: the worker that made the id and its counter there.

    A plain 2-tuple compares and hashes equal, so ids that crossed the wire as tuples still
    find their records.
    """

    created_on: int
    local_id: int


RRefId: TypeAlias = GloballyUniqueId
ForkId: TypeAlias = GloballyUniqueId


# -- messages (between RRefProtocol instances; the agent carries them) ------------------------


@dataclass(frozen=True, slots=True)
class ForkRequest:
    """Child to owner: register ``fork_id`` (held by the sender), forked by worker ``parent``."""

    rref_id: RRefId
    fork_id: ForkId
    parent: int


@dataclass(frozen=True, slots=True)
class ForkAccept:
    """Owner to child: ``fork_id`` is registered; the child is confirmed."""

    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class ChildAccept:
    """Child (or the owner, when it is the child) to parent: drop pending child ``fork_id``."""

    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class UserDelete:
    """User to owner: the user reference ``fork_id`` is gone."""

    rref_id: RRefId
    fork_id: ForkId


Message: TypeAlias = ForkRequest | ForkAccept | ChildAccept | UserDelete


# -- actions (for the agent to perform) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to worker ``dst`` (never this worker; never a worker known dead)."""

    dst: int
    msg: Message


@dataclass(frozen=True, slots=True)
class DeleteOwner:
    """The owner record is gone: free the value of ``rref_id``. Emitted once per record."""

    rref_id: RRefId


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The user reference ``fork_id`` is confirmed by its owner (``confirmed_by_owner``)."""

    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class RRefLost:
    """The value of ``rref_id`` cannot be reached from here: fail whatever waits on it.

    On a user: the owner died. On the owner: the value will never be created (its creator died
    before the ``remote()`` request arrived) or was already deleted.
    """

    rref_id: RRefId
    reason: str


@dataclass(frozen=True, slots=True)
class ProtocolWarning:
    """A message was ignored (unknown fork, duplicate, wrong sender); state is unchanged."""

    text: str


Action: TypeAlias = Send | DeleteOwner | Confirmed | RRefLost | ProtocolWarning


# -- results and snapshots ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ForkDecision:
    """What ``fork_for`` decided: the fork id to pickle, and actions to perform now."""

    fork_id: ForkId
    actions: tuple[Action, ...] = ()


class OwnerState(enum.Enum):
    """The owner's view of one RRef's value."""

    PENDING = "pending"  # seen in a message before its remote() request: no value yet
    LIVE = "live"  # created (remote() arrived, or a local RRef(value))
    ABANDONED = "abandoned"  # will never get a value (creator died, or already deleted)


@dataclass(frozen=True, slots=True)
class UserInfo:
    """A snapshot of one user reference."""

    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int | None  # the worker it came from; None for the creator of a remote()
    confirmed: bool
    held: bool  # a local Python object still refers to it
    released: bool  # released locally, or by release_all_users()
    lost: bool  # its owner is dead, or its remote() was never sent
    children: tuple[ForkId, ...]  # pending children forked from it


@dataclass(frozen=True, slots=True)
class LeakInfo:
    """A reference still alive at shutdown: a user held locally, or a fork an owner still has."""

    rref_id: RRefId
    fork_id: ForkId
    owner: int
    creator: int
    holder: int  # the worker holding the fork
    role: str  # "user": held by a local Python object; "fork": still registered on the owner

    def __str__(self) -> str:
        where = "held locally" if self.role == "user" else f"held by worker {self.holder}"
        return (
            f"Leaking RRef {self.rref_id} with fork Id {self.fork_id} "
            f"(owner: worker {self.owner}, created on worker {self.creator}, {where})"
        )


# -- records -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _User:
    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int | None
    confirmed: bool
    held: bool = True
    forced: bool = False  # released by release_all_users()
    lost: bool = False
    children: set[ForkId] = field(default_factory=set)

    @property
    def released(self) -> bool:
        return self.forced or not self.held


@dataclass(slots=True)
class _Child:
    rref_id: RRefId
    fork_id: ForkId
    parent_fork: ForkId  # the local user reference kept alive by it
    dst: int  # the worker whose ChildAccept (or death) ends it


@dataclass(slots=True)
class _Owner:
    rref_id: RRefId
    state: OwnerState
    forks: dict[ForkId, int] = field(default_factory=dict)  # fork -> worker holding it
    local_refs: int = 0


def _gid(value: tuple[int, int]) -> GloballyUniqueId:
    return value if type(value) is GloballyUniqueId else GloballyUniqueId(*value)


class RRefProtocol:
    """The RRef reference-counting state of one worker (see the module docstring).

    Not thread-safe: the agent holds one lock around every call and performs the returned
    actions in order.

    Args:
        worker_id: this worker's id; it is also the ``created_on`` of every id made here.
    """

    def __init__(self, worker_id: int) -> None:
        self._me = worker_id
        self._next = 0
        self._users: dict[ForkId, _User] = {}
        self._children: dict[ForkId, _Child] = {}
        self._owners: dict[RRefId, _Owner] = {}
        self._dead: set[int] = set()
        self._shut_down = False
        self._shutdown_leaks: list[LeakInfo] = []

    @property
    def worker_id(self) -> int:
        """This worker's id."""
        return self._me

    # -- creation ------------------------------------------------------------------------------

    def create_owner_local(self) -> RRefId:
        """A local ``RRef(value)``: this worker owns it, with one local reference and no forks.

        Returns:
            The new RRefId. Call ``owner_released(rref_id)`` when the Python object dies.
        """
        rref_id = self._new_id()
        self._owners[rref_id] = _Owner(rref_id, OwnerState.LIVE, local_refs=1)
        return rref_id

    def create_user_for_remote(self, owner: int) -> tuple[RRefId, ForkId]:
        """The creator's side of ``remote()`` to ``owner``: a new, unconfirmed user reference.

        Args:
            owner: the callee, which will own the value. Not this worker (a ``remote()`` to
                oneself is a local ``RRef``: use ``create_owner_local``).

        Returns:
            ``(rref_id, fork_id)``: two new ids, in that order (as torch numbers them).
            ``confirm(fork_id)`` when the reply arrives;
            ``fork_not_sent(rref_id, fork_id)`` if the request is not sent.

        Raises:
            LocalProtocolError: ``owner`` is this worker.
            PeerError: ``owner`` is known dead.
        """
        if owner == self._me:
            raise LocalProtocolError(
                f"worker {self._me}: remote() to itself makes an owner, not a user; "
                "use create_owner_local()"
            )
        self._check_alive(owner, "create an RRef owned by")
        rref_id = self._new_id()
        fork_id = self._new_id()
        self._users[fork_id] = _User(rref_id, fork_id, owner, parent=None, confirmed=False)
        return rref_id, fork_id

    def owner_created_by_remote(
        self, rref_id: RRefId, fork_id: ForkId, creator: int
    ) -> list[Action]:
        """The owner's side of ``remote()``: the request arrived; register the creator's fork.

        Call in arrival order, before running the function.

        Args:
            rref_id: the RRefId carried by the request.
            fork_id: the creator's fork.
            creator: the worker that sent the request.

        Returns:
            Actions (a ``ProtocolWarning`` if the request is a duplicate).
        """
        rref_id, fork_id = _gid(rref_id), _gid(fork_id)
        owner = self._owners.get(rref_id)
        if owner is None:
            owner = self._owners[rref_id] = _Owner(rref_id, OwnerState.LIVE)
        elif owner.state is OwnerState.LIVE:
            return [self._warn(f"remote() request for RRef {rref_id} from {creator} twice")]
        elif fork_id in owner.forks:
            return [self._warn(f"remote() fork {fork_id} of RRef {rref_id} already registered")]
        owner.state = OwnerState.LIVE
        owner.forks[fork_id] = creator
        return []

    def confirm(self, fork_id: ForkId) -> list[Action]:
        """The reply to the ``remote()`` that created user ``fork_id`` arrived (any outcome).

        Returns:
            ``Confirmed(fork_id)``, and a ``UserDelete`` if the user was already released.
        """
        fork_id = _gid(fork_id)
        user = self._users.get(fork_id)
        if user is None or user.parent is not None:
            return [self._warn(f"confirm of unknown remote() user {fork_id}")]
        if user.lost:
            return []
        if user.confirmed:
            return [self._warn(f"remote() user {fork_id} confirmed twice")]
        user.confirmed = True
        return [Confirmed(fork_id), *self._user_maybe_done(user)]

    # -- forking (pickling) and receiving (unpickling) ----------------------------------------

    def fork_for(
        self, rref_id: RRefId, holder: ForkId | None, owner: int, dst: int
    ) -> ForkDecision:
        """An RRef is being pickled into a message for ``dst``: make a fork for it.

        Args:
            rref_id: the RRef.
            holder: on a user, the fork id of the user reference being pickled; on the owner,
                None.
            owner: the RRef's owner (this worker, or the holder's owner).
            dst: the worker the message goes to.

        Returns:
            The fork id to pickle along with ``rref_id``, ``owner`` and this worker as parent.

        Raises:
            LocalProtocolError: the RRef or the holder is unknown, released, or does not match.
            PeerError: ``dst`` or the owner is known dead.
        """
        rref_id = _gid(rref_id)
        if self._shut_down:
            raise LocalProtocolError(
                f"worker {self._me}: cannot fork RRef {rref_id} after release_all_users()"
            )
        self._check_alive(dst, f"send RRef {rref_id} to")
        if owner == self._me:
            if holder is not None:
                raise LocalProtocolError(
                    f"worker {self._me} owns RRef {rref_id}; fork_for takes holder=None here"
                )
            record = self._owners.get(rref_id)
            if record is None or record.local_refs == 0:
                raise LocalProtocolError(
                    f"worker {self._me}: fork of RRef {rref_id}, which has no local reference "
                    "here (never created, released, or deleted)"
                )
            fork_id = self._new_id()
            record.forks[fork_id] = dst  # dst == self too: see "owner to itself" above
            return ForkDecision(fork_id)
        if holder is None:
            raise LocalProtocolError(
                f"worker {self._me}: fork of RRef {rref_id} owned by {owner} needs the holder's "
                "fork id"
            )
        holder = _gid(holder)
        user = self._users.get(holder)
        if user is None or user.rref_id != rref_id or user.owner != owner:
            raise LocalProtocolError(
                f"worker {self._me}: no user reference {holder} of RRef {rref_id} owned by {owner}"
            )
        if user.released:
            raise LocalProtocolError(
                f"worker {self._me}: user reference {holder} of RRef {rref_id} was released"
            )
        if user.lost:
            raise PeerError(
                f"worker {self._me}: cannot send RRef {rref_id}: its owner, worker {owner}, failed",
                peer=owner,
            )
        fork_id = self._new_id()
        self._children[fork_id] = _Child(rref_id, fork_id, holder, dst)
        user.children.add(fork_id)
        return ForkDecision(fork_id)

    def fork_not_sent(self, rref_id: RRefId, fork_id: ForkId) -> list[Action]:
        """The message carrying ``fork_id`` (from ``fork_for``, or a ``remote()`` request from
        ``create_user_for_remote``) was not sent after all: undo the fork.

        Unknown forks are ignored (the fork may already be settled).

        Returns:
            Actions: a ``DeleteOwner`` or ``UserDelete`` the undo made possible; ``RRefLost`` for
            a ``remote()`` that never went out.
        """
        rref_id, fork_id = _gid(rref_id), _gid(fork_id)
        owner = self._owners.get(rref_id)
        if owner is not None and fork_id in owner.forks:
            del owner.forks[fork_id]
            return self._owner_maybe_done(owner)
        if fork_id in self._children:
            return self._drop_child(fork_id)
        user = self._users.get(fork_id)
        if user is not None and user.parent is None and not user.confirmed and not user.lost:
            user.lost = True
            reason = f"the remote() request to worker {user.owner} was not sent"
            return [RRefLost(rref_id, reason), *self._user_maybe_done(user)]
        return []

    def received(self, rref_id: RRefId, fork_id: ForkId, owner: int, parent: int) -> list[Action]:
        """An RRef was unpickled from a message sent by ``parent``.

        On the owner: one more local reference (end it with ``owner_released``). On a user:
        a new user reference ``fork_id`` (end it with ``user_released``), confirmed at once if
        ``parent`` is the owner, else after the owner answers the ``ForkRequest`` sent now.

        Returns:
            Actions (``Send``, ``Confirmed``, ``RRefLost`` if the owner is known dead,
            ``ProtocolWarning`` for a duplicate fork).
        """
        rref_id, fork_id = _gid(rref_id), _gid(fork_id)
        if owner == self._me:
            return self._received_on_owner(rref_id, fork_id, parent)
        if fork_id in self._users:
            return [self._warn(f"fork {fork_id} of RRef {rref_id} from {parent} received twice")]
        user = _User(rref_id, fork_id, owner, parent, confirmed=parent == owner)
        self._users[fork_id] = user
        if self._shut_down:  # a late arrival: held by a Python object that shutdown won't see
            user.forced = True
            self._shutdown_leaks.append(self._user_leak(user))
        actions: list[Action]
        if owner in self._dead:
            user.lost = True
            actions = [RRefLost(rref_id, f"its owner, worker {owner}, failed")]
            actions += self._send(parent, ChildAccept(rref_id, fork_id))
        elif user.confirmed:
            actions = [Confirmed(fork_id)]
        else:
            actions = self._send(owner, ForkRequest(rref_id, fork_id, parent))
        return actions + self._user_maybe_done(user)  # after shutdown it is released at once

    def _received_on_owner(self, rref_id: RRefId, fork_id: ForkId, parent: int) -> list[Action]:
        actions: list[Action] = []
        record = self._owners.get(rref_id)
        if parent == self._me:
            # Sent to itself: the fork registered by fork_for becomes a local reference.
            if record is None or fork_id not in record.forks:
                return [self._warn(f"self-sent fork {fork_id} of RRef {rref_id} is unknown")]
            del record.forks[fork_id]
            record.local_refs += 1
            return actions
        if record is None:
            record, actions = self._adopt(rref_id, via=parent)
        record.local_refs += 1
        actions += self._send(parent, ChildAccept(rref_id, fork_id))
        return actions

    # -- local release -------------------------------------------------------------------------

    def user_released(self, fork_id: ForkId) -> list[Action]:
        """The last local Python object of user reference ``fork_id`` died.

        Returns:
            ``[Send(owner, UserDelete)]`` if it was confirmed with no pending children, else
            nothing yet (it goes out when the last condition is met).

        Raises:
            LocalProtocolError: unknown or already released (not after ``release_all_users``,
                where unknown forks are ignored).
        """
        fork_id = _gid(fork_id)
        user = self._users.get(fork_id)
        if user is None:
            if self._shut_down:
                return []
            raise LocalProtocolError(f"worker {self._me}: release of unknown user fork {fork_id}")
        if not user.held:
            raise LocalProtocolError(f"worker {self._me}: user fork {fork_id} released twice")
        user.held = False
        return self._user_maybe_done(user)

    def owner_released(self, rref_id: RRefId) -> list[Action]:
        """One local Python object of an RRef owned here died.

        Returns:
            ``[DeleteOwner(rref_id)]`` if that was the last reference and no fork is left.

        Raises:
            LocalProtocolError: no local reference is left to release.
        """
        rref_id = _gid(rref_id)
        record = self._owners.get(rref_id)
        if record is None or record.local_refs == 0:
            raise LocalProtocolError(
                f"worker {self._me}: release of RRef {rref_id}, which has no local reference here"
            )
        record.local_refs -= 1
        return self._owner_maybe_done(record)

    # -- messages ------------------------------------------------------------------------------

    def handle(self, src: int, msg: Message) -> list[Action]:
        """A protocol message from worker ``src`` arrived.

        Returns:
            Actions; a ``ProtocolWarning`` (and no change) for a message that does not fit.
        """
        if src in self._dead:
            return [self._warn(f"{msg!r} from worker {src} after it was declared failed")]
        if isinstance(msg, ForkRequest):
            return self._on_fork_request(src, msg)
        if isinstance(msg, ForkAccept):
            return self._on_fork_accept(src, msg)
        if isinstance(msg, ChildAccept):
            return self._on_child_accept(src, msg)
        if isinstance(msg, UserDelete):
            return self._on_user_delete(src, msg)
        return [self._warn(f"unknown message {msg!r} from worker {src}")]

    def _on_fork_request(self, src: int, msg: ForkRequest) -> list[Action]:
        actions: list[Action] = []
        record = self._owners.get(msg.rref_id)
        if record is None:
            record, actions = self._adopt(msg.rref_id, via=msg.parent)
        elif msg.fork_id in record.forks:
            return [self._warn(f"{msg!r} from {src}: fork already registered")]
        record.forks[msg.fork_id] = src
        actions += self._send(src, ForkAccept(msg.rref_id, msg.fork_id))
        return actions

    def _on_fork_accept(self, src: int, msg: ForkAccept) -> list[Action]:
        user = self._users.get(msg.fork_id)
        if user is None or user.rref_id != msg.rref_id or user.owner != src:
            return [self._warn(f"{msg!r} from {src}: no such unconfirmed user here")]
        if user.confirmed:
            return [self._warn(f"{msg!r} from {src}: already confirmed")]
        user.confirmed = True
        actions: list[Action] = [Confirmed(user.fork_id)]
        if user.parent is not None and user.parent != user.owner:
            actions += self._send(user.parent, ChildAccept(user.rref_id, user.fork_id))
        actions += self._user_maybe_done(user)
        return actions

    def _on_child_accept(self, src: int, msg: ChildAccept) -> list[Action]:
        child = self._children.get(msg.fork_id)
        if child is None or child.rref_id != msg.rref_id or child.dst != src:
            return [self._warn(f"{msg!r} from {src}: no such pending child here")]
        return self._drop_child(msg.fork_id)

    def _on_user_delete(self, src: int, msg: UserDelete) -> list[Action]:
        record = self._owners.get(msg.rref_id)
        if record is None or record.forks.get(msg.fork_id) != src:
            return [self._warn(f"{msg!r} from {src}: no such fork held by {src} here")]
        del record.forks[msg.fork_id]
        return self._owner_maybe_done(record)

    # -- failure and shutdown ------------------------------------------------------------------

    def peer_failed(self, worker: int) -> list[Action]:
        """Worker ``worker`` died. Call after every message it sent was handed in.

        Returns:
            ``RRefLost`` for each RRef owned by it that this worker holds (and for pending
            owners it created), plus the ``UserDelete``/``DeleteOwner`` this made possible.
            Idempotent.

        Raises:
            LocalProtocolError: ``worker`` is this worker.
        """
        if worker == self._me:
            raise LocalProtocolError(f"worker {self._me}: peer_failed() on itself")
        if worker in self._dead:
            return []
        self._dead.add(worker)
        actions: list[Action] = []
        for fork_id in [c.fork_id for c in self._children.values() if c.dst == worker]:
            child = self._children.pop(fork_id)
            self._users[child.parent_fork].children.discard(fork_id)
        lost: set[RRefId] = set()
        for user in list(self._users.values()):
            if user.owner == worker and not user.lost:
                user.lost = True
                if user.rref_id not in lost:
                    lost.add(user.rref_id)
                    actions.append(RRefLost(user.rref_id, f"its owner, worker {worker}, failed"))
                if not user.confirmed and user.parent not in (None, worker):
                    # Never to be confirmed now: let the parent go (it waits for this only).
                    actions += self._send(user.parent, ChildAccept(user.rref_id, user.fork_id))
            actions += self._user_maybe_done(user)
        for record in list(self._owners.values()):
            for fork_id in [f for f, holder in record.forks.items() if holder == worker]:
                del record.forks[fork_id]
            if record.state is OwnerState.PENDING and record.rref_id.created_on == worker:
                record.state = OwnerState.ABANDONED
                reason = f"its creator, worker {worker}, failed before its remote() arrived"
                actions.append(RRefLost(record.rref_id, reason))
            actions += self._owner_maybe_done(record)
        return actions

    def release_all_users(self) -> list[Action]:
        """Graceful shutdown (torch's ``delAllUsersAndUnforkedOwners``): release every user.

        Users still held locally are recorded for ``leaks()`` and released; their
        ``UserDelete`` goes out now, or when their confirmations arrive (wait for ``idle()``).
        Afterwards ``fork_for`` raises, ``user_released`` ignores unknown forks, and users
        received later are released at once (and listed by ``leaks()``). Owners are left to
        their forks and local references.

        Returns:
            The ``UserDelete`` sends that can go out now.
        """
        self._shut_down = True
        actions: list[Action] = []
        for user in list(self._users.values()):
            if user.held and not user.forced:
                self._shutdown_leaks.append(self._user_leak(user))
            user.forced = True
            actions += self._user_maybe_done(user)
        return actions

    # -- queries -------------------------------------------------------------------------------

    def has_owner(self, rref_id: RRefId) -> bool:
        """Whether this worker has an owner record for ``rref_id`` (in any ``OwnerState``)."""
        return _gid(rref_id) in self._owners

    def owner_state(self, rref_id: RRefId) -> OwnerState | None:
        """The state of the owner record of ``rref_id``; None if there is none (never seen or
        deleted)."""
        record = self._owners.get(_gid(rref_id))
        return None if record is None else record.state

    def user(self, fork_id: ForkId) -> UserInfo | None:
        """A snapshot of user reference ``fork_id``, or None once it is deleted."""
        user = self._users.get(_gid(fork_id))
        return None if user is None else self._user_info(user)

    def all_users(self) -> list[UserInfo]:
        """Snapshots of every user reference on this worker."""
        return [self._user_info(u) for u in self._users.values()]

    def idle(self) -> bool:
        """No pending children, no unconfirmed users, no owner with forks: nothing in flight."""
        return (
            not self._children
            and all(u.confirmed or u.lost for u in self._users.values())
            and not any(r.forks for r in self._owners.values())
        )

    def debug_counts(self) -> dict[str, int]:
        """Torch's RRef context figures: values owned here that other workers reference
        (``owners``: a local ``RRef`` counts once shared, and no longer once every other
        reference is gone), forks registered on them (``forks``), and user references here
        not confirmed by their owner yet (``pending_users``)."""
        return {
            "owners": sum(1 for r in self._owners.values() if r.forks),
            "forks": sum(len(r.forks) for r in self._owners.values()),
            "pending_users": sum(1 for u in self._users.values() if not (u.confirmed or u.lost)),
        }

    def pending(self) -> str:
        """What keeps ``idle()`` false, one line each; empty when idle."""
        lines = [
            f"user {c.parent_fork} of RRef {c.rref_id} waits for worker {c.dst} to accept "
            f"child fork {c.fork_id}"
            for c in self._children.values()
        ]
        lines += [
            f"user {u.fork_id} of RRef {u.rref_id} waits for confirmation by owner {u.owner}"
            for u in self._users.values()
            if not (u.confirmed or u.lost)
        ]
        lines += [
            f"owned RRef {r.rref_id} ({r.state.value}) has forks "
            + ", ".join(f"{f}@{holder}" for f, holder in r.forks.items())
            for r in self._owners.values()
            if r.forks
        ]
        return "\n".join(f"worker {self._me}: {line}" for line in lines)

    def leaks(self) -> list[LeakInfo]:
        """User references held locally (including those ``release_all_users`` released), and
        forks still registered on RRefs owned here."""
        leaks = list(self._shutdown_leaks)
        leaks += [self._user_leak(u) for u in self._users.values() if u.held and not u.forced]
        leaks += [
            LeakInfo(r.rref_id, fork_id, self._me, r.rref_id.created_on, holder, "fork")
            for r in self._owners.values()
            for fork_id, holder in r.forks.items()
        ]
        return leaks

    # -- internals -----------------------------------------------------------------------------

    def _new_id(self) -> GloballyUniqueId:
        gid = GloballyUniqueId(self._me, self._next)
        self._next += 1
        return gid

    def _check_alive(self, worker: int, what: str) -> None:
        if worker in self._dead:
            raise PeerError(f"worker {self._me}: cannot {what} worker {worker}: it failed", worker)

    def _warn(self, text: str) -> ProtocolWarning:
        return ProtocolWarning(f"worker {self._me}: ignored {text}")

    def _send(self, dst: int, msg: Message) -> list[Action]:
        if dst == self._me:
            return self.handle(dst, msg)
        if dst in self._dead:
            return []
        return [Send(dst, msg)]

    def _adopt(self, rref_id: RRefId, via: int) -> tuple[_Owner, list[Action]]:
        """Create the owner record of an RRef first seen in a message forked by ``via``."""
        creator = rref_id.created_on
        if creator == self._me:
            reason = "it was created here and is already deleted"
        elif creator in self._dead:
            reason = f"its creator, worker {creator}, failed before its remote() arrived"
        elif via in self._dead:
            reason = f"it was forked by worker {via}, which failed; it may be deleted already"
        else:
            record = self._owners[rref_id] = _Owner(rref_id, OwnerState.PENDING)
            return record, []
        record = self._owners[rref_id] = _Owner(rref_id, OwnerState.ABANDONED)
        return record, [RRefLost(rref_id, reason)]

    def _user_maybe_done(self, user: _User) -> list[Action]:
        if not user.released or user.children:
            return []
        if user.lost:
            del self._users[user.fork_id]
            return []
        if not user.confirmed:
            return []
        del self._users[user.fork_id]
        return self._send(user.owner, UserDelete(user.rref_id, user.fork_id))

    def _owner_maybe_done(self, record: _Owner) -> list[Action]:
        if record.forks or record.local_refs:
            return []
        del self._owners[record.rref_id]
        if record.state is OwnerState.LIVE:
            return [DeleteOwner(record.rref_id)]
        return []  # pending or abandoned: no value was made

    def _drop_child(self, fork_id: ForkId) -> list[Action]:
        child = self._children.pop(fork_id)
        parent = self._users[child.parent_fork]
        parent.children.discard(fork_id)
        return self._user_maybe_done(parent)

    def _user_leak(self, user: _User) -> LeakInfo:
        return LeakInfo(
            user.rref_id, user.fork_id, user.owner, user.rref_id.created_on, self._me, "user"
        )

    @staticmethod
    def _user_info(user: _User) -> UserInfo:
        return UserInfo(
            rref_id=user.rref_id,
            fork_id=user.fork_id,
            owner=user.owner,
            parent=user.parent,
            confirmed=user.confirmed,
            held=user.held,
            released=user.released,
            lost=user.lost,
            children=tuple(sorted(user.children)),
        )
