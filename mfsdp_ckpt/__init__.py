"""mfsdp_ckpt: the checkpoint layer (DCP planners, storage, resharding, HF bridge).

Not built yet: the canonical DCP checkpoint is issue #3. It reads the runtime only through
``mfsdp_core.describe_shards`` (docs/shard_description.md)."""
