"""``tdist.elastic.rendezvous.utils``: the module path of torch's, for its
``parse_rendezvous_endpoint`` (``HOST[:PORT]``, IPv6 in brackets)."""

from . import parse_rendezvous_endpoint

__all__ = ["parse_rendezvous_endpoint"]
