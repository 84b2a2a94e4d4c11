"""Sharded checkpoints of a running job: ``save`` / ``load`` (``checkpoint``), ``async_save``, the
canonical state of a sharded model and optimizer (``state``), DCP planners (``planner``), expert
parallelism's global plan (``experts``), MX planes (``mx_load``), and offline resharding to
another layout of the runtime (``reshard``). The only layer that talks to ``torch.distributed``
and the runtime (``mfsdp_core``). Above ``write``; the bridges ``hf`` and ``mcore`` build on it."""
