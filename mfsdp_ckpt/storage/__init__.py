"""Storage: local paths and fsspec URLs behind one interface (``fs``: exists, list, open, read,
write whole files atomically, remove; the fsspec client under it in ``remote``), DCP's
file-system interface on object stores (``objstore``), the run directory's writer lock
(``lock``), write-then-rename (``staging``), early write-back (``writeback``), failed writes
as one line (``write_errors``) and the one loop of positioned reads and writes (``positioned``). The only layer that asks whether a path is a URL. Above
``format``."""
