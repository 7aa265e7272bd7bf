"""The configurations of ``scripts/dist_check.py``, one module per family.

``common`` holds what they share, ``registry`` files each configuration under its
name; ``fsdp2``, ``ddp``, ``capture``, ``cache`` and ``loops`` register theirs.
``scripts/`` is the import root (``torchrun scripts/dist_check.py`` puts it first on
``sys.path``)."""
