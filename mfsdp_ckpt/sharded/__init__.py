"""Sharded checkpoints of a running job: ``save`` / ``load`` (``checkpoint``), ``async_save``, the
canonical state of a sharded model and optimizer (``state``), DCP planners (``planner``), the
manifest's layout of a save (``save_layout``), MX planes (``mx_load``), and offline resharding to
another layout of the runtime (``reshard``). The only layer that talks to ``torch.distributed``
(expert parallelism's plan algebra, pure, is in ``model``). Above ``write``; the bridges ``hf``
and ``mcore`` build on it."""
