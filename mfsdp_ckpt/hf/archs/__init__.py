"""One module per Hugging Face architecture, each defining ``ARCH`` (a
:class:`mfsdp_ckpt.hf.mapping.Architecture`). The registry imports every module here whose name
does not start with ``_``: adding an architecture is adding one file."""
