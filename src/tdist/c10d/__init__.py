"""c10d: process groups, collectives and the algorithms behind them.

``_schedules`` holds the collective algorithms as pure schedules (no I/O); ``_simulate`` runs
them in one process as a reference executor.

The module-level API (``tdist.init_process_group``, ``tdist.all_reduce``, ...) lives in
``_api``; ``_group`` holds ``ProcessGroup`` and the world registry, ``_checks`` the argument
rules, ``_backend_config`` backend names, ``_debug`` the ``DETAIL`` collective checks,
``_objects`` the pickling of object collectives. ``tdist/__init__.py`` re-exports them.
"""
