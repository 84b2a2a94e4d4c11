"""Writing checkpoints, through one path: ``destination`` (where an output goes: local or object
store, decided once; open, commit, abort), ``agreement`` (how the ranks of a job agree on a
failure), ``job`` (the one ``write_and_commit`` of every collective writer, the live save
included), ``dcp_writer`` (DCP's writer with checksums), ``builder`` (chunk at a time, for the
offline tools), ``manifest`` (writing ``mfsdp.json``) and ``run_dir`` (``latest`` and pruning).
Above ``read``."""
