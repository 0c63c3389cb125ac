"""``tdist.elastic.multiprocessing``: the module path of ``torch.distributed.elastic.multiprocessing``
(its ``errors.record``, which workers under ``tdist run`` use as under torchrun)."""
