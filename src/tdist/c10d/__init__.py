"""c10d: process groups, collectives and the algorithms behind them.

``_schedules`` holds the collective algorithms as pure schedules (no I/O); ``_simulate`` runs
them in one process as a reference executor.

The module-level API (``tdist.init_process_group``, ``tdist.all_reduce``, ...) is gathered in
``_api`` from ``_world`` (resolving groups and ranks, the queries), ``_lifecycle`` (making and
destroying groups), ``_p2p``, ``_collectives``, ``_legacy`` (deprecated and ``*_multigpu``
forms) and ``_objects`` (the object collectives and their pickling); ``_group`` holds
``ProcessGroup`` and the world registry, ``_checks`` the argument rules, ``_backend_config``
backend names, ``_debug`` the ``DETAIL`` collective checks. ``tdist/__init__.py`` re-exports
them.
"""
