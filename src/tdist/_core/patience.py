"""How long a wait goes on before it says what it waits for: a wait of other processes (ranks
at a rendezvous or forming a group, workers at an RPC shutdown, nodes of a launcher, a store
that does not answer) that lasts ``FIRST`` seconds logs a warning naming them, then one every
``EVERY`` seconds, until it ends or times out. One place for every such wait, read when each
wait starts (tests shorten them)."""

from __future__ import annotations

FIRST = 30.0  # seconds before the first word: longer than a start-up's usual skew
EVERY = 60.0  # seconds between two words after it


class Words:
    """When one wait speaks: ``due(waited)`` is True once ``waited`` (seconds since the wait
    began) reaches ``FIRST``, then again ``EVERY`` seconds after each time it was."""

    def __init__(self) -> None:
        self._next = FIRST

    def due(self, waited: float) -> bool:
        if waited < self._next:
            return False
        self._next = waited + EVERY
        return True
