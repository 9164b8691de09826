"""comera_dist.engine: the DeepSpeed side of training (the only package importing deepspeed).

Modules: ``config`` (train/deepspeed sections, batch arithmetic, DeepSpeed JSON), ``distributed``
(rank discovery, process group), ``build`` (model + ``deepspeed.initialize``), ``hooks`` (ZeRO-aware
rank penalty), ``prune`` (gather, slice, rebuild), ``checkpoint`` (atomic sharded checkpoints),
``session`` (``TrainSession``), ``trainer`` (the loop). Nothing is imported here, so that importing
a config class does not start DeepSpeed.
"""
