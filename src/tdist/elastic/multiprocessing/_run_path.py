"""``tdist run --run-path``'s worker: ``python -u -m tdist.elastic.multiprocessing._run_path
SCRIPT ARGS`` runs ``SCRIPT`` as ``__main__`` (``runpy.run_path``, ``sys.argv`` its own, its
folder first on ``sys.path`` as for ``python SCRIPT``) under ``@record``, as torchrun's
``--run-path`` does: an exception that escapes it goes to ``TORCHELASTIC_ERROR_FILE`` (the
failure report's ``error_file``), and the process then ends as Python ends it (the traceback on
stderr, exit code 1).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> None:
    from .errors import record

    script, *args = argv
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    record(runpy.run_path)(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
