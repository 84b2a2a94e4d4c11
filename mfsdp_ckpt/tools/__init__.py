"""The offline tools over every format: ``inspect`` and ``verify`` (``inspect``), ``diff``,
``convert`` (single-file formats) and ``ls`` (``listing``). The top layer: above the bridges,
whose formats they read too."""
