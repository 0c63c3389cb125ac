"""What kind of process this is.

``TORCHLESS`` is set by the ``tdist`` command (``tdist.cli.console_main``) before it imports
anything else of tdist: the launcher and the store server run no user code and handle no tensor,
so they skip importing torch, which costs about two seconds of CPU at every ``tdist run`` (before
any worker starts). In such a process, tdist's errors derive from stand-ins shaped like torch's
exception tree instead of torch's classes. Nothing else changes, and a process that imports
torch anyway (``"torch" in sys.modules`` when ``tdist._core.errors`` is first imported) keeps
torch's classes.
"""

from __future__ import annotations

TORCHLESS = False
