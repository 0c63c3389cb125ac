"""``python -m tdist.run``: ``tdist run`` under the name of ``python -m torch.distributed.run``
(torchrun's module), with the same options (see ``tdist run --help``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> int:
    """``tdist run`` with ``args`` (the command line's by default); returns the exit code."""
    from .cli import main as cli_main

    return cli_main(["run", *(sys.argv[1:] if args is None else args)])


if __name__ == "__main__":
    from ._core import _process

    _process.TORCHLESS = True  # (as the tdist command: the launcher does not import torch)
    sys.exit(main())
