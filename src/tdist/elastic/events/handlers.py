"""``torch.distributed.elastic.events.handlers``: the destinations' logging handlers (a program
may replace one in ``_log_handlers``)."""

from ._api import _log_handlers, get_logging_handler

__all__ = ["get_logging_handler"]
_ = _log_handlers  # (torch's module holds the table; so does this one, by name)
