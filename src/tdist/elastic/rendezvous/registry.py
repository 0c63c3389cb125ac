"""``tdist.elastic.rendezvous.registry``: the module path of torch's, for
``from ...rendezvous.registry import get_rendezvous_handler``."""

from . import get_rendezvous_handler, rendezvous_handler_registry

__all__ = ["get_rendezvous_handler", "rendezvous_handler_registry"]
