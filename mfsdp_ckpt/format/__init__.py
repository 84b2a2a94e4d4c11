"""The format: what a checkpoint's names, keys and records are, as pure functions of values
(no I/O; nothing here imports ``torch.distributed``, and torch only inside the functions that
handle tensors: ``tests/test_import_graph.py`` checks it): the file and marker names (``names``),
canonical key spellings (``keys``), flat ranges as boxes (``boxes``), chunk ids and crc32c
(``checksum``), the data files' record tables (``record_table``), where every chunk of a save
lives (``catalog``), the manifest's fields and checksums (``manifest``) and its schema
(``manifest_schema``), the model-source record (``model_source``) and its LoRA adapters (``lora``) and the safe unpickler of DCP's
``.metadata`` (``safety``). Imports nothing of ``mfsdp_ckpt`` but ``errors``."""
