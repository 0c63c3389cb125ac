"""``tdist.elastic.utils``: the module path of ``torch.distributed.elastic.utils`` (its store
helpers, ``store``, and ``distributed.get_free_port``)."""
