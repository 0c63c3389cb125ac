"""``torch.distributed.nn.api``: see ``remote_module``."""
