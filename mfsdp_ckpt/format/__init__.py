"""The format: what a checkpoint's names, keys and records are, as pure functions of values
(no I/O, no torch.distributed): the file and marker names (``names``), canonical key spellings
(``keys``), flat ranges as boxes (``boxes``), chunk ids and crc32c (``checksum``), the manifest's
schema (``manifest_schema``), the model-source record (``model_source``) and the safe unpickler of
DCP's ``.metadata`` (``safety``). Imports nothing of ``mfsdp_ckpt`` but ``errors``."""
