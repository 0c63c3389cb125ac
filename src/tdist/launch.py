"""``python -m tdist.launch``: ``torch.distributed.launch`` (deprecated in torch for torchrun)
under tdist's name, for the scripts written for it.

torchrun's options, plus ``--use-env`` (``--use_env``): without it each worker gets
``--local-rank=<its local rank>`` as its first argument (which such a script parses), with it
only the ``LOCAL_RANK`` environment variable, as under torchrun. A failed worker raises
torch's ``ChildFailedError``.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence

__all__ = ["get_args_parser", "launch", "main", "parse_args", "run"]


def get_args_parser() -> argparse.ArgumentParser:
    """The legacy launcher's parser: torchrun's options and ``--use-env``."""
    from .run import get_args_parser as torchrun_parser

    parser = torchrun_parser()
    parser.add_argument(
        "--use-env", "--use_env", default=False, action="store_true",
        help="give the worker its local rank in LOCAL_RANK only, not as --local-rank",
    )
    return parser


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """The legacy launcher's options: torchrun's and ``--use-env``."""
    return get_args_parser().parse_args(args)


def run(args: argparse.Namespace) -> None:
    """``tdist.run.run`` (torch's module has torchrun's ``run`` under this name too)."""
    from .run import run as run_job

    run_job(args)


def launch(args: argparse.Namespace) -> None:
    """Run the job ``args`` describe (``tdist.run.run``).

    Raises:
        ValueError: ``--no-python`` without ``--use-env`` (a program cannot be given
            ``--local-rank``, as torch says).
    """
    if args.no_python and not args.use_env:
        raise ValueError("When using the '--no-python' flag, you must also set the '--use-env' flag.")
    run(args)


def main(args: Sequence[str] | None = None) -> None:
    warnings.warn(
        "tdist.launch, as torch.distributed.launch, is deprecated: use tdist run (torchrun). "
        "Scripts should read their local rank from the LOCAL_RANK environment variable.",
        FutureWarning,
        stacklevel=2,
    )
    launch(parse_args(args))


if __name__ == "__main__":
    main()
