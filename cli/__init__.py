"""The ``mfsdp-ckpt`` command line (click front end over ``mfsdp_ckpt``). Not built yet (issue #5)."""
