"""Integrations with training stacks. Each submodule imports its stack lazily (on use),
and ``import gns_kernels`` imports none of them.

- ``gns_kernels.integrations.dcp``: ``DCPState``, the coordinator (or a hook state) under
  ``torch.distributed.checkpoint`` with every rank's share kept (torchtitan and other
  FSDP2 stacks checkpoint through DCP)
- ``gns_kernels.integrations.lightning``: ``GNSCallback`` for a Lightning ``Trainer``
- ``gns_kernels.integrations.huggingface``: ``GNSTrainerCallback`` (logging) and
  ``AdaptiveTrainer`` (adaptive batch) for the Hugging Face ``Trainer``
- ``gns_kernels.integrations.wandb``: ``WandbWriter``, ``coord.metrics()`` to W&B
- ``gns_kernels.integrations.torchtitan``: ``GNSTrainer`` and the ``GNS`` config component
  for torchtitan 0.3 (FSDP2)

docs/integrations.md has the lines a user adds for each stack.
"""
