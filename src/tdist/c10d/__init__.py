"""c10d: process groups, collectives and the algorithms behind them.

``_schedules`` holds the collective algorithms as pure schedules (no I/O); ``_simulate`` runs
them in one process as a reference executor.
"""
