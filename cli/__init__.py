"""The ``mfsdp-ckpt`` command line: a click front end over ``mfsdp_ckpt`` (parse, call, print)."""
