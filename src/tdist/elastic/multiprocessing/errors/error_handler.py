"""``tdist.elastic.multiprocessing.errors.error_handler``: the module path of torch's, where its
``ErrorHandler`` is defined (the same class as ``tdist.elastic.multiprocessing.errors``')."""

from . import ErrorHandler

__all__ = ["ErrorHandler"]
