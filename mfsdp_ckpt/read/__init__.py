"""Reading checkpoints: what a path is (``locate``: ours, stock DCP, Megatron-Core, a ``latest``
pointer), reading the manifest (``manifest``), ``.metadata`` checked after the safe unpickle
(``metadata_check``), chunks and their bytes (``chunks``, ``records``, ``staged_read``), DCP's
reader with verification (``dcp_reader``), the one-entry-at-a-time reader of the offline tools
(``reader``), stock key layouts and key renaming (``stock``, ``mapped``). Above ``storage``."""
