"""``tdist.elastic.multiprocessing.errors.handlers``: the module path of torch's, for its
``get_error_handler``."""

from . import get_error_handler

__all__ = ["get_error_handler"]
