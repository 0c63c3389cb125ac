"""The arena's collectives: ``ShmArena``, an ``ArenaCore`` with ``all_reduce``, ``reduce``,
``broadcast``, ``all_gather``, ``gather``, ``scatter``, ``reduce_scatter``, ``all_to_all`` and
``barrier``.

Algorithms
----------
``all_reduce`` of at most ``small_bytes`` (64 KiB): one frame. Each rank copies its tensor into
its slot, arrives, and reduces all slots itself in rank order (so every rank gets bitwise the
same result). One wait per call.

``all_reduce`` above that, and ``reduce``: blocks of ``F`` bytes; block ``b`` is cut into
``world_size`` 64-byte-aligned chunks. Rank ``r`` copies every chunk but its own into its slot
(``W``), reduces chunk ``r`` reading its own tensor and every peer's slot, with ``out=`` into
its own slot (``X``), then copies every rank's reduced chunk out (``D``): about two copies and
one reduction pass per byte, against gloo's several trips through loopback TCP. The loop is
software-pipelined: ``copy-in(b + 1)``, ``reduce(b)``, ``copy-out(b - 1)``, so a rank rarely
waits for a peer that is one step behind (this needs ``K >= 3``; the default is 4).

Copy collectives stream frames with one frame of look-ahead: ``broadcast`` (the root writes,
the others read), ``all_gather``/``gather`` (everyone writes its input, everyone / the root
reads every slot), ``scatter``/``all_to_all``/``reduce_scatter`` (a writer's frame is cut into
``world_size`` sub-frames, one per destination; ``reduce_scatter`` reduces on read).

While an operation runs, torch's intra-op threads of the thread that runs it are capped at the
rank's share of the cores (``cores // world_size``; ``_threads.capped``: no process-wide setting
changes): a rank is one busy thread already, and OpenMP threads beyond the free
cores wait for each other to be scheduled (64 MiB all_reduce of 2 processes on 2 cores: 650 ms
with torch's default 2 threads each, 12 ms with 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch

from .._threads import PARALLEL_BYTES, capped
from .._types import RedOpType, as_red_op
from ._core import ArenaCore
from ._layout import _D, _W, _X, _dtype_code, _Kind, _round_up
from ._tensors import Reducer, _check_tensor, _flat, _reducer, copy_back

__all__ = ["ShmArena"]

_NULL_CONTEXT = contextlib.nullcontext()


class ShmArena(ArenaCore):
    """A shared-memory arena for the collectives of ``size`` ranks on one host.

    Every rank of the group constructs one, with the same ``name``, at the same time; the
    constructor exchanges each rank's ``record`` (its pid, its wake-up pipe, rank 0's segment)
    through ``store`` and returns once it has every rank's and has mapped the segment. With
    ``store=None`` it returns at once, its own half made: the caller exchanges the records
    itself and calls ``join(records)`` (or ``close()`` to give it up).

    Args:
        store: a store private to the group (a ``PrefixStore``); keys go under ``shm/<name>/``.
            Arenas of one name are paired by the order in which each rank makes them. ``None``:
            see above.
        rank: this rank, ``0 <= rank < size``.
        size: the number of ranks.
        name: names the arena in keys, file names and messages; unique among the live arenas
            sharing ``store``.
        timeout: the default deadline of each operation (and of construction), seconds.
        heartbeat_interval: seconds between heartbeats (written every third of it).
        stall_timeout: a peer whose heartbeat is this much older than ours is stalled
            (default ``3 * heartbeat_interval``).
        frame_bytes: bytes of one frame (a multiple of 4096, at least ``max(65536, 4096 * size)``;
            default ``default_frame_bytes(size)``).
        frames: frames per rank ring (at least 3).
        small_bytes: ``all_reduce``/``reduce`` of at most this many bytes take the one-frame path.
        spin_us: how long a waiter spins before it blocks in the kernel (``_core.spin``).
        beats: write this rank's heartbeat from a thread of the arena's own; ``False``: the
            owner calls ``beat()`` from one of its own (a thread fewer to start).

    Raises:
        ValueError: bad arguments.
        DistBackendError: this machine's memory order is weaker than x86's
            (``memory_order_ok``).
        DistTimeoutError, PeerError, DistStoreError: the other ranks did not all join in time.

    Thread-safety: call an arena's methods from one thread at a time.
    """

    # -- collectives -----------------------------------------------------------------------------
    def barrier(self, *, timeout: float | timedelta | None = None) -> None:
        """Block until every rank has called ``barrier``.

        Raises:
            PeerError: a peer died, stalled, closed the arena or failed.
            DistTimeoutError: not every rank arrived within ``timeout`` (default: the arena's).
            CollectiveMismatchError: a peer called another collective.
        """
        deadline = self._enter("barrier", timeout)
        try:
            self._sync(_Kind.BARRIER, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``tensor`` across ranks in place; every rank gets the result.

        Args:
            tensor: a CPU tensor of any dtype the reduction supports; it may be a
                non-contiguous view (only the view's elements are written).
            op: the reduction (``AVG`` on floating-point and complex tensors only; ``MIN`` and
                ``MAX`` not on complex; ``BAND``/``BOR``/``BXOR`` on integers and bool only).
            timeout: seconds (or a ``timedelta``) for the whole call; default: the arena's.

        Raises:
            ValueError: ``op`` cannot reduce this dtype (raised on every rank, nothing sent).
            CollectiveMismatchError: the ranks' calls disagree (op, dtype, element count).
            PeerError: a peer died, stalled, closed the arena or failed.
            DistTimeoutError: the deadline expired.
        """
        _check_tensor(tensor, "all_reduce")
        red = as_red_op(op)
        fn = _reducer(tensor.dtype, red, "all_reduce")
        deadline = self._enter("all_reduce", timeout)
        if self.size == 1:
            return
        try:
            with self._mode((tensor,)):
                flat, copied = _flat(tensor)
                self._reduce(_Kind.ALL_REDUCE, flat, red, fn, -1, deadline)
                if copied:
                    copy_back(tensor, flat)
        except BaseException as exc:
            self._fail(exc)
            raise

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``tensor`` across ranks into ``root``'s ``tensor``; the others' are unchanged.

        Args and Raises: as ``all_reduce``, plus ``root`` (ValueError when out of range).
        """
        _check_tensor(tensor, "reduce")
        self._check_root(root, "reduce")
        red = as_red_op(op)
        fn = _reducer(tensor.dtype, red, "reduce")
        deadline = self._enter("reduce", timeout)
        if self.size == 1:
            return
        try:
            with self._mode((tensor,)):
                if self.rank == root:
                    flat, copied = _flat(tensor)
                else:
                    flat, copied = tensor.reshape(-1), False  # read only: a copy will do
                self._reduce(_Kind.REDUCE, flat, red, fn, root, deadline)
                if copied:
                    copy_back(tensor, flat)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _reduce(
        self, kind: _Kind, flat: torch.Tensor, op: RedOpType, fn: Reducer, root: int, deadline: float
    ) -> None:
        if flat.numel() * flat.element_size() <= self._small:
            self._reduce_small(kind, flat, op, fn, root, deadline)
        else:
            self._reduce_large(kind, flat, op, fn, root, deadline)

    def _reduce_small(
        self, kind: _Kind, flat: torch.Tensor, op: RedOpType, fn: Reducer, root: int, deadline: float
    ) -> None:
        numel = flat.numel()
        dtype = flat.dtype
        f = self._write_desc(kind, _dtype_code(dtype), int(op), root, numel)
        self._credit(f, deadline)
        k = f % self._K
        key = (dtype, numel)
        slots_by_k = self._slot_cache.get(key)
        if slots_by_k is None:
            # slicing costs microseconds: a training loop reduces the same sizes again and again
            if len(self._slot_cache) >= 64:
                self._slot_cache.clear()
            views = self._frames_of(dtype)
            slots_by_k = [[views[q][j][:numel] for q in range(self.size)] for j in range(self._K)]
            self._slot_cache[key] = slots_by_k
        slots = slots_by_k[k]
        slots[self.rank].copy_(flat)
        self._pub(_W, f + 1)
        self._arrive(f, deadline)
        if root < 0 or root == self.rank:
            # every rank sums in rank order: bitwise the same result everywhere
            fn(slots[0], slots[1], flat)
            for q in range(2, self.size):
                fn(flat, slots[q], flat)
            if op is RedOpType.AVG:
                flat.div_(self.size)
        self._pub(_D, f + 1)
        self._done(1)

    def _reduce_large(
        self, kind: _Kind, flat: torch.Tensor, op: RedOpType, fn: Reducer, root: int, deadline: float
    ) -> None:
        n, r, K = self.size, self.rank, self._K
        peers = self._peers
        numel = flat.numel()
        E = self._F // flat.element_size()
        A = max(1, 64 // flat.element_size())
        nb = -(-numel // E)
        f0 = self._write_desc(kind, _dtype_code(flat.dtype), int(op), root, numel)
        views = self._frames_of(flat.dtype)
        mine = views[r]
        avg = op is RedOpType.AVG
        out_here = root < 0 or root == r

        def chunks(b: int) -> tuple[int, list[tuple[int, int]]]:
            # block b cut into n chunks on 64-byte boundaries; trailing chunks may be empty
            lo = b * E
            m = min(E, numel - lo)
            per = _round_up(-(-m // n), A)
            return lo, [(min(m, j * per), min(m, (j + 1) * per)) for j in range(n)]

        def copy_in(b: int) -> None:
            f = f0 + b
            self._credit(f, deadline)
            lo, cs = chunks(b)
            frame = mine[f % K]
            for j in peers:
                s, e = cs[j]
                if e > s:
                    frame[s:e].copy_(flat[lo + s: lo + e])
            self._pub(_W, f + 1)

        def reduce(b: int) -> None:
            f = f0 + b
            if b == 0:
                self._arrive(f0, deadline)
            else:
                self._wait(_W, f + 1, deadline)
            lo, cs = chunks(b)
            s, e = cs[r]
            k = f % K
            if e > s:
                out = mine[k][s:e]
                others = [views[q][k][s:e] for q in peers]
                fn(flat[lo + s: lo + e], others[0], out)
                for o in others[1:]:
                    fn(out, o, out)
                if avg:
                    out.div_(n)
            self._pub(_X, f + 1)

        def copy_out(b: int) -> None:
            f = f0 + b
            if out_here:
                self._wait(_X, f + 1, deadline)
                lo, cs = chunks(b)
                k = f % K
                for j in range(n):
                    s, e = cs[j]
                    if e > s:
                        flat[lo + s: lo + e].copy_(views[j][k][s:e])
            self._pub(_D, f + 1)

        # software pipeline: copy-in(b + 1), reduce(b), copy-out(b - 1); a rank waits only for
        # a peer more than a step behind
        copy_in(0)
        for b in range(nb):
            if b + 1 < nb:
                copy_in(b + 1)
            reduce(b)
            if b:
                copy_out(b - 1)
        copy_out(nb - 1)
        self._done(nb)

    def broadcast(
        self, tensor: torch.Tensor, root: int, *, timeout: float | timedelta | None = None
    ) -> None:
        """Copy ``root``'s ``tensor`` into every rank's ``tensor`` (any dtype, any view).

        Raises:
            ValueError: ``root`` out of range.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(tensor, "broadcast")
        self._check_root(root, "broadcast")
        deadline = self._enter("broadcast", timeout)
        if self.size == 1:
            return
        try:
            with self._mode((tensor,)):
                self._broadcast(tensor, root, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _broadcast(self, tensor: torch.Tensor, root: int, deadline: float) -> None:
        r, K = self.rank, self._K
        is_root = r == root
        flat, copied = _flat(tensor)
        numel = flat.numel()
        E = self._F // flat.element_size()
        nf = max(1, -(-numel // E))
        f0 = self._write_desc(_Kind.BROADCAST, _dtype_code(flat.dtype), -1, root, numel)
        views = self._frames_of(flat.dtype)

        def write(s: int) -> None:
            f = f0 + s
            if is_root:
                lo = s * E
                m = min(E, numel - lo)
                if m > 0:
                    self._credit(f, deadline)
                    views[r][f % K][:m].copy_(flat[lo: lo + m])
            self._pub(_W, f + 1)

        def read(s: int) -> None:
            f = f0 + s
            if not is_root:
                lo = s * E
                m = min(E, numel - lo)
                self._wait(_W, f + 1, deadline, (root,))
                if m > 0:
                    flat[lo: lo + m].copy_(views[root][f % K][:m])
            self._pub(_D, f + 1)

        write(0)
        self._arrive(f0, deadline)
        self._pipeline(nf, write, read)
        if copied and not is_root:
            copy_back(tensor, flat)

    def all_gather(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Gather every rank's ``input`` into ``outputs[rank]`` on every rank.

        Ranks may contribute different numbers of elements: ``outputs[q]`` must have as many as
        rank ``q``'s ``input`` (checked across ranks).

        Raises:
            ValueError: ``outputs`` is not one tensor per rank, or dtypes differ, or
                ``outputs[rank]`` does not match ``input``.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        self._check_list(outputs, "all_gather", "outputs")
        _check_tensor(input, "all_gather")
        self._check_dtypes(outputs, input.dtype, "all_gather")
        if outputs[self.rank].numel() != input.numel():
            raise ValueError(
                f"all_gather: outputs[{self.rank}] has {outputs[self.rank].numel()} elements but "
                f"this rank's input has {input.numel()}"
            )
        deadline = self._enter("all_gather", timeout)
        try:
            with self._mode((*outputs, input)):
                flats = [_flat(o) for o in outputs]
                self._all_gather([f for f, _ in flats], input.reshape(-1), deadline)
                for o, (f, copied) in zip(outputs, flats, strict=True):
                    if copied:
                        o.copy_(f.view(o.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float | timedelta | None = None
    ) -> None:
        """Gather every rank's ``input`` into ``output`` (``size`` times as many elements),
        rank ``q``'s at ``output.view(-1)[q * n:(q + 1) * n]``.

        Raises:
            ValueError: sizes or dtypes do not fit.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "all_gather_into_tensor")
        _check_tensor(input, "all_gather_into_tensor")
        if output.dtype != input.dtype or output.numel() != self.size * input.numel():
            raise ValueError(
                f"all_gather_into_tensor: output ({output.dtype}, {output.numel()} elements) must "
                f"be {self.size} x input ({input.dtype}, {input.numel()} elements)"
            )
        deadline = self._enter("all_gather_into_tensor", timeout)
        try:
            with self._mode((output, input)):
                flat, copied = _flat(output)
                # a view of output's own block as input (the in-place idiom) reads before writes
                blocks = list(torch.split(flat, input.numel())) if input.numel() else [flat] * self.size
                self._all_gather(blocks, input.reshape(-1), deadline)
                if copied:
                    output.copy_(flat.view(output.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def _all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor, deadline: float) -> None:
        n, r, K = self.size, self.rank, self._K
        sizes = [o.numel() for o in outs]
        if n == 1:
            outs[0].copy_(inp)
            return
        E = self._F // inp.element_size()
        nf = max(1, -(-max(sizes) // E))
        f0 = self._write_desc(_Kind.ALL_GATHER, _dtype_code(inp.dtype), numel=inp.numel())
        views = self._frames_of(inp.dtype)
        mine = sizes[r]

        def write(s: int) -> None:
            f = f0 + s
            lo = s * E
            m = min(E, mine - lo)
            if m > 0:
                self._credit(f, deadline)
                views[r][f % K][:m].copy_(inp[lo: lo + m])
            self._pub(_W, f + 1)

        def read(s: int) -> None:
            f = f0 + s
            lo = s * E
            k = f % K
            self._wait(_W, f + 1, deadline)
            for q in range(n):
                m = min(E, sizes[q] - lo)
                if m > 0:
                    outs[q][lo: lo + m].copy_(inp[lo: lo + m] if q == r else views[q][k][:m])
            self._pub(_D, f + 1)

        write(0)
        self._arrive(f0, deadline, same_numel=False, check_failed=False)
        descs = self._descs()
        for q in self._peers:
            if descs[q].numel != sizes[q]:
                self._mismatch(
                    q, descs[r], descs[q],
                    f": rank {r} expects {sizes[q]} elements from rank {q}, which sends {descs[q].numel}",
                )
        self._check_failed()
        self._pipeline(nf, write, read)

    def gather(
        self,
        outputs: Sequence[torch.Tensor] | None,
        input: torch.Tensor,
        root: int,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Gather every rank's ``input`` into ``outputs`` on ``root`` (``outputs[q]`` gets rank
        ``q``'s; sizes may differ per rank). Other ranks pass ``outputs=None`` (ignored).

        Raises:
            ValueError: bad ``root``, or on the root ``outputs`` is not one tensor per rank of
                ``input``'s dtype.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(input, "gather")
        self._check_root(root, "gather")
        r, n, K = self.rank, self.size, self._K
        is_root = r == root
        if is_root:
            self._check_list(outputs, "gather", "outputs")
            assert outputs is not None
            self._check_dtypes(outputs, input.dtype, "gather")
            if outputs[r].numel() != input.numel():
                raise ValueError(
                    f"gather: outputs[{r}] has {outputs[r].numel()} elements but the root's input "
                    f"has {input.numel()}"
                )
        deadline = self._enter("gather", timeout)
        try:
            with self._mode((*(outputs or ()), input)):
                inp = input.reshape(-1)
                flats = [_flat(o) for o in outputs] if is_root and outputs is not None else []
                outs = [f for f, _ in flats]
                if n == 1:
                    outs[0].copy_(inp)
                else:
                    E = self._F // inp.element_size()
                    mine = inp.numel()
                    f0 = self._write_desc(_Kind.GATHER, _dtype_code(inp.dtype), root=root, numel=mine)
                    views = self._frames_of(inp.dtype)

                    def write(s: int) -> None:
                        f = f0 + s
                        lo = s * E
                        m = min(E, mine - lo)
                        if m > 0 and not is_root:
                            self._credit(f, deadline)
                            views[r][f % K][:m].copy_(inp[lo: lo + m])
                        self._pub(_W, f + 1)

                    def read(s: int) -> None:
                        f = f0 + s
                        if is_root:
                            lo = s * E
                            k = f % K
                            self._wait(_W, f + 1, deadline)
                            for q in range(n):
                                m = min(E, outs[q].numel() - lo)
                                if m > 0:
                                    outs[q][lo: lo + m].copy_(inp[lo: lo + m] if q == r else views[q][k][:m])
                        self._pub(_D, f + 1)

                    write(0)
                    self._arrive(f0, deadline, same_numel=False, check_failed=False)
                    descs = self._descs()
                    if is_root:
                        for q in self._peers:
                            if descs[q].numel != outs[q].numel():
                                self._mismatch(
                                    q, descs[r], descs[q],
                                    f": the root expects {outs[q].numel()} elements from rank {q}, "
                                    f"which sends {descs[q].numel}",
                                )
                    nf = max(1, -(-max(d.numel for d in descs) // E))
                    self._check_failed()
                    self._pipeline(nf, write, read)
                for o, (f, copied) in zip(outputs or (), flats, strict=False):
                    if copied:
                        o.copy_(f.view(o.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None,
        root: int,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Copy ``inputs[q]`` on ``root`` into ``output`` on rank ``q`` (sizes may differ per
        rank). Other ranks pass ``inputs=None`` (ignored).

        Raises:
            ValueError: bad ``root``, or on the root ``inputs`` is not one tensor per rank of
                ``output``'s dtype.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "scatter")
        self._check_root(root, "scatter")
        r, n, K = self.rank, self.size, self._K
        is_root = r == root
        if is_root:
            self._check_list(inputs, "scatter", "inputs")
            assert inputs is not None
            self._check_dtypes(inputs, output.dtype, "scatter")
            if inputs[r].numel() != output.numel():
                raise ValueError(
                    f"scatter: inputs[{r}] has {inputs[r].numel()} elements but the root's output "
                    f"has {output.numel()}"
                )
        deadline = self._enter("scatter", timeout)
        try:
            with self._mode((output, *(inputs or ()))):
                out, copied = _flat(output)
                ins = [t.reshape(-1) for t in inputs] if is_root and inputs is not None else []
                sizes = [t.numel() for t in ins]
                if n == 1:
                    out.copy_(ins[0])
                else:
                    Es = self._sub_elems(out.element_size())
                    f0 = self._write_desc(_Kind.SCATTER, _dtype_code(out.dtype), root=root, sizes=sizes)
                    views = self._frames_of(out.dtype)

                    def write(s: int) -> None:
                        f = f0 + s
                        if is_root:
                            lo = s * Es
                            self._credit(f, deadline)
                            frame = views[r][f % K]
                            for q in self._peers:
                                m = min(Es, sizes[q] - lo)
                                if m > 0:
                                    frame[q * Es: q * Es + m].copy_(ins[q][lo: lo + m])
                        self._pub(_W, f + 1)

                    def read(s: int) -> None:
                        f = f0 + s
                        lo = s * Es
                        m = min(Es, out.numel() - lo)
                        if is_root:
                            if m > 0:
                                out[lo: lo + m].copy_(ins[r][lo: lo + m])
                        else:
                            self._wait(_W, f + 1, deadline, (root,))
                            if m > 0:
                                out[lo: lo + m].copy_(views[root][f % K][r * Es: r * Es + m])
                        self._pub(_D, f + 1)

                    write(0)
                    self._arrive(f0, deadline, same_numel=False, check_failed=False)
                    descs = self._descs()
                    theirs = descs[root].sizes
                    if len(theirs) != n or theirs[r] != out.numel():
                        self._mismatch(
                            root, descs[r], descs[root],
                            f": rank {r} expects {out.numel()} elements from the root",
                        )
                    nf = max(1, -(-max(theirs) // Es))
                    self._check_failed()
                    self._pipeline(nf, write, read)
                if copied:
                    output.copy_(out.view(output.shape))
        except BaseException as exc:
            self._fail(exc)
            raise

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``inputs[q]`` across ranks into ``output`` on rank ``q``.

        ``inputs`` has one tensor per rank; ``inputs[q]`` has as many elements as rank ``q``'s
        ``output`` (the same list of sizes on every rank, checked).

        Raises:
            ValueError: sizes, dtypes or ``op`` do not fit.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "reduce_scatter")
        self._check_list(inputs, "reduce_scatter", "inputs")
        self._check_dtypes(inputs, output.dtype, "reduce_scatter")
        if inputs[self.rank].numel() != output.numel():
            raise ValueError(
                f"reduce_scatter: inputs[{self.rank}] has {inputs[self.rank].numel()} elements but "
                f"output has {output.numel()}"
            )
        red = as_red_op(op)
        fn = _reducer(output.dtype, red, "reduce_scatter")
        deadline = self._enter("reduce_scatter", timeout)
        try:
            with self._mode((output, *inputs)):
                self._reduce_scatter(output, [t.reshape(-1) for t in inputs], red, fn, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: RedOpType = RedOpType.SUM,
        *,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Reduce ``input`` (``size`` times ``output``'s elements) across ranks; rank ``q``'s
        ``output`` gets block ``q`` of the result.

        Raises:
            ValueError: sizes, dtypes or ``op`` do not fit.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        _check_tensor(output, "reduce_scatter_tensor")
        _check_tensor(input, "reduce_scatter_tensor")
        if output.dtype != input.dtype or input.numel() != self.size * output.numel():
            raise ValueError(
                f"reduce_scatter_tensor: input ({input.dtype}, {input.numel()} elements) must be "
                f"{self.size} x output ({output.dtype}, {output.numel()} elements)"
            )
        red = as_red_op(op)
        fn = _reducer(output.dtype, red, "reduce_scatter_tensor")
        deadline = self._enter("reduce_scatter_tensor", timeout)
        try:
            with self._mode((output, input)):
                flat = input.reshape(-1)
                ins = list(torch.split(flat, output.numel())) if output.numel() else [flat] * self.size
                self._reduce_scatter(output, ins, red, fn, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _reduce_scatter(
        self, output: torch.Tensor, ins: list[torch.Tensor], op: RedOpType, fn: Reducer, deadline: float
    ) -> None:
        n, r, K = self.size, self.rank, self._K
        out, copied = _flat(output)
        if n == 1:
            out.copy_(ins[0])
        else:
            sizes = [t.numel() for t in ins]
            Es = self._sub_elems(out.element_size())
            nf = max(1, -(-max(sizes) // Es))
            f0 = self._write_desc(
                _Kind.REDUCE_SCATTER, _dtype_code(out.dtype), int(op), sizes=sizes
            )
            views = self._frames_of(out.dtype)
            avg = op is RedOpType.AVG

            def write(s: int) -> None:
                f = f0 + s
                lo = s * Es
                self._credit(f, deadline)
                frame = views[r][f % K]
                for q in self._peers:
                    m = min(Es, sizes[q] - lo)
                    if m > 0:
                        frame[q * Es: q * Es + m].copy_(ins[q][lo: lo + m])
                self._pub(_W, f + 1)

            def read(s: int) -> None:
                f = f0 + s
                lo = s * Es
                k = f % K
                m = min(Es, sizes[r] - lo)
                self._wait(_W, f + 1, deadline)
                if m > 0:
                    dst = out[lo: lo + m]
                    others = [views[q][k][r * Es: r * Es + m] for q in self._peers]
                    fn(ins[r][lo: lo + m], others[0], dst)
                    for o in others[1:]:
                        fn(dst, o, dst)
                    if avg:
                        dst.div_(n)
                self._pub(_D, f + 1)

            write(0)
            self._arrive(f0, deadline, same_numel=False, check_failed=False)
            descs = self._descs()
            for q in self._peers:
                if descs[q].sizes != tuple(sizes):
                    self._mismatch(q, descs[r], descs[q], ": the ranks' input sizes differ")
            self._check_failed()
            self._pipeline(nf, write, read)
        if copied:
            output.copy_(out.view(output.shape))

    def all_to_all(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        timeout: float | timedelta | None = None,
        op: str = "all_to_all",
    ) -> None:
        """Send ``inputs[q]`` to rank ``q``, which receives it in its ``outputs[rank]``.

        Sizes may differ per pair: ``outputs[q]`` must have as many elements as rank ``q``'s
        ``inputs[rank]`` (checked across ranks). ``op``: the operation's name in errors
        (``all_to_all_single`` comes here too).

        Raises:
            ValueError: lists of the wrong length or mixed dtypes.
            CollectiveMismatchError, PeerError, DistTimeoutError: as ``all_reduce``.
        """
        self._check_list(outputs, op, "outputs")
        self._check_list(inputs, op, "inputs")
        dtype = inputs[0].dtype
        self._check_dtypes(inputs, dtype, op)
        self._check_dtypes(outputs, dtype, op)
        deadline = self._enter(op, timeout)
        try:
            with self._mode((*outputs, *inputs)):
                self._all_to_all(outputs, inputs, deadline)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _all_to_all(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], deadline: float
    ) -> None:
        n, r, K = self.size, self.rank, self._K
        ins = [t.reshape(-1) for t in inputs]
        flats = [_flat(o) for o in outputs]
        outs = [f for f, _ in flats]
        sizes = [t.numel() for t in ins]
        if outs[r].numel() != sizes[r]:
            raise ValueError(
                f"all_to_all: outputs[{r}] has {outs[r].numel()} elements but inputs[{r}] has "
                f"{sizes[r]}"
            )
        if n == 1:
            outs[0].copy_(ins[0])
        else:
            Es = self._sub_elems(ins[0].element_size())
            f0 = self._write_desc(_Kind.ALL_TO_ALL, _dtype_code(ins[0].dtype), sizes=sizes)
            views = self._frames_of(ins[0].dtype)

            def write(s: int) -> None:
                f = f0 + s
                lo = s * Es
                self._credit(f, deadline)
                frame = views[r][f % K]
                for q in self._peers:
                    m = min(Es, sizes[q] - lo)
                    if m > 0:
                        frame[q * Es: q * Es + m].copy_(ins[q][lo: lo + m])
                self._pub(_W, f + 1)

            def read(s: int) -> None:
                f = f0 + s
                lo = s * Es
                k = f % K
                self._wait(_W, f + 1, deadline)
                for q in range(n):
                    m = min(Es, outs[q].numel() - lo)
                    if m > 0:
                        src = ins[r][lo: lo + m] if q == r else views[q][k][r * Es: r * Es + m]
                        outs[q][lo: lo + m].copy_(src)
                self._pub(_D, f + 1)

            write(0)
            self._arrive(f0, deadline, same_numel=False, check_failed=False)
            descs = self._descs()
            for q in self._peers:
                theirs = descs[q].sizes
                if len(theirs) != n or theirs[r] != outs[q].numel():
                    got = theirs[r] if len(theirs) == n else "?"
                    self._mismatch(
                        q, descs[r], descs[q],
                        f": rank {r} expects {outs[q].numel()} elements from rank {q}, which sends {got}",
                    )
            nf = max(1, -(-max(max(d.sizes, default=0) for d in descs) // Es))
            self._check_failed()
            self._pipeline(nf, write, read)
        for o, (f, copied) in zip(outputs, flats, strict=True):
            if copied:
                o.copy_(f.view(o.shape))

    def _mode(self, tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
        """The context an operation runs in: autograd off if a tensor requires grad (in-place
        writes into a leaf would raise), intra-op threads capped for large tensors."""
        grad = False
        nbytes = 0
        for t in tensors:
            grad = grad or t.requires_grad
            nbytes += t.numel() * t.element_size()
        cap = nbytes > PARALLEL_BYTES and torch.get_num_threads() > self._threads
        if not grad and not cap:
            return _NULL_CONTEXT
        return self._mode_slow(grad, cap)

    @contextlib.contextmanager
    def _mode_slow(self, grad: bool, cap: bool) -> Iterator[None]:
        # Each rank is one busy thread already: with more OpenMP threads than free cores the
        # threads of one parallel region wait for each other to be scheduled (measured here:
        # 64 MiB all_reduce 50x slower with torch's default 2 threads per rank on 2 cores).
        with capped(self._threads) if cap else _NULL_CONTEXT, torch.no_grad() if grad else _NULL_CONTEXT:
            yield

    # -- argument checks -------------------------------------------------------------------------
    def _sub_elems(self, itemsize: int) -> int:
        """Elements of one destination's sub-frame (64-byte aligned)."""
        A = max(1, 64 // itemsize)
        return (self._F // itemsize // self.size) // A * A

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{what}: root {root} is not a rank of this group of {self.size}")

    def _check_list(self, tensors: Sequence[torch.Tensor] | None, what: str, name: str) -> bool:
        if tensors is None or len(tensors) != self.size:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            raise ValueError(f"{what}: {name} must hold one tensor per rank ({self.size}), got {got}")
        for t in tensors:
            _check_tensor(t, what)
        return True

    @staticmethod
    def _check_dtypes(tensors: Sequence[torch.Tensor], dtype: torch.dtype, what: str) -> None:
        for t in tensors:
            if t.dtype != dtype:
                raise ValueError(f"{what}: all tensors must have dtype {dtype}, got {t.dtype}")
