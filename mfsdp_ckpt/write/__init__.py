"""Writing checkpoints: DCP's writer with checksums and the atomic commit (``dcp_writer``) and
the chunk-at-a-time builder of the offline tools (``builder``). Above ``read``."""
