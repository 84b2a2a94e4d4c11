"""The offline tools over every format: ``inspect`` and ``verify`` (``inspect``), ``diff``,
``convert`` (single-file formats), ``ls`` (``listing``) and ``upcycle`` (a dense checkpoint as an
MoE one whose experts copy its MLP). The top layer: above the bridges, whose formats they read too."""
