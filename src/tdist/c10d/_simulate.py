"""A reference executor: runs a whole world's schedules in one process, on numpy arrays.

Theory of operation. Every rank's workspace is a dict ``chunk id -> array``, filled with its
``Schedule.inputs``. The world advances in lockstep, one step index at a time: first every send
of the step reads its chunks (copies, so the values are those from before the step, as the
execution model in ``_schedules`` requires), then every receive applies the matching payload,
``COPY`` by replacing the chunk, ``REDUCE`` by ``combine(current, received)``. The result is
each rank's ``outputs``. Alongside the data it tracks who has heard from whom (a message carries
the set of ranks its sender has heard from), which is what a barrier must establish.

It is a test oracle and a worked example of the chunk layouts, not a fast path: no I/O, no
threads. ``split`` and ``join`` cut a flat array into ``chunk_bounds`` pieces and back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ._schedules import Action, Schedule, ScheduleError, Step, chunk_bounds

__all__ = ["Combine", "SimulationResult", "join", "simulate", "split"]

Combine = Callable[[NDArray[np.generic], NDArray[np.generic]], NDArray[np.generic]]


@dataclass(frozen=True)
class SimulationResult:
    """What every rank ends with.

    Attributes:
        outputs: per rank, its ``Schedule.outputs`` chunks.
        heard_from: per rank, the ranks whose messages reached it, directly or through others
            (itself included).
    """

    outputs: list[dict[int, NDArray[np.generic]]]
    heard_from: list[frozenset[int]]


def split(array: NDArray[np.generic], nchunks: int) -> dict[int, NDArray[np.generic]]:
    """Cut a flat array into ``nchunks`` pieces with ``chunk_bounds`` (copies)."""
    return {c: array[a:b].copy() for c, (a, b) in enumerate(chunk_bounds(array.size, nchunks))}


def join(chunks: Mapping[int, NDArray[np.generic]], nchunks: int) -> NDArray[np.generic]:
    """Concatenate chunks ``0 .. nchunks - 1`` back into one flat array."""
    return np.concatenate([chunks[c] for c in range(nchunks)])


def simulate(
    schedules: Sequence[Schedule],
    inputs: Sequence[Mapping[int, NDArray[np.generic]]],
    combine: Combine = np.add,
) -> SimulationResult:
    """Run all ranks' schedules to completion.

    Args:
        schedules: one schedule per rank, in rank order (check them with ``check_schedules``
            first for clear messages).
        inputs: per rank, an array for each chunk in its ``Schedule.inputs`` (more is ignored).
        combine: the reduction, elementwise, for ``REDUCE`` receives.

    Returns:
        The outputs of every rank and who heard from whom.

    Raises:
        ScheduleError: when a rank lacks an input, sends or reduces into a chunk it does not
            hold, or a receive has no matching send.
    """
    n = len(schedules)
    state: list[dict[int, NDArray[np.generic]]] = []
    for r, s in enumerate(schedules):
        missing = s.inputs - inputs[r].keys()
        if missing:
            raise ScheduleError(f"simulate: rank {r} has no input for chunks {sorted(missing)}")
        state.append({c: np.array(inputs[r][c], copy=True) for c in s.inputs})
    heard = [{r} for r in range(n)]
    nsteps = max((s.num_steps for s in schedules), default=0)

    def step_of(r: int, k: int) -> Step:
        steps = schedules[r].steps
        return steps[k] if k < len(steps) else Step()

    for k in range(nsteps):
        wire: dict[
            tuple[int, int], tuple[tuple[int, ...], list[NDArray[np.generic]], frozenset[int]]
        ] = {}
        for r in range(n):
            for snd in step_of(r, k).sends:
                try:
                    payload = [state[r][c].copy() for c in snd.chunks]
                except KeyError as exc:
                    raise ScheduleError(
                        f"simulate: rank {r} step {k} sends chunk {exc} it does not hold"
                    ) from None
                wire[(r, snd.peer)] = (snd.chunks, payload, frozenset(heard[r]))
        for r in range(n):
            for rcv in step_of(r, k).recvs:
                msg = wire.pop((rcv.peer, r), None)
                if msg is None or msg[0] != rcv.chunks:
                    raise ScheduleError(
                        f"simulate: rank {r} step {k} receives {rcv.chunks} from "
                        f"rank {rcv.peer}, which sends "
                        f"{None if msg is None else msg[0]}"
                    )
                chunks, payload, sender_heard = msg
                heard[r] |= sender_heard
                for c, data in zip(chunks, payload, strict=True):
                    if rcv.action is Action.COPY:
                        state[r][c] = data
                    elif c not in state[r]:
                        raise ScheduleError(
                            f"simulate: rank {r} step {k} reduces into chunk {c} it does not hold"
                        )
                    else:
                        state[r][c] = combine(state[r][c], data)
        if wire:
            (src, dst), (chunks, _, _) = next(iter(wire.items()))
            raise ScheduleError(
                f"simulate: rank {src} step {k} sends {chunks} to rank {dst}, "
                "which does not receive it"
            )
    outputs = []
    for r, s in enumerate(schedules):
        missing = s.outputs - state[r].keys()
        if missing:
            raise ScheduleError(f"simulate: rank {r} ends without chunks {sorted(missing)}")
        outputs.append({c: state[r][c] for c in s.outputs})
    return SimulationResult(outputs, [frozenset(h) for h in heard])
