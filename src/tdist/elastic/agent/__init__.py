"""``tdist.elastic.agent``: the module path of ``torch.distributed.elastic.agent`` (see
``server``)."""
