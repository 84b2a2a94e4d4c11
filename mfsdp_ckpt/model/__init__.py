"""What a checkpoint's model is, apart from where its bytes live: the shape of the transformer a
checkpoint holds and that transformer on the meta device (``shape``: the one seam to the
reference model, which the bridges ``hf`` and ``mcore`` and the tools reach it through), and the
plan algebra of expert parallelism (``experts``: one global plan from every rank's, optimizer
groups merged across ranks, expert counts, regrouping for another EP size), as pure functions of
plain data. No I/O and no communication. Above ``format``, below ``storage``; imports nothing
of ``mfsdp_ckpt`` but ``errors``."""
