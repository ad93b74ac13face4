"""The ``lightning-tune`` commands, one module each: ``demo``, ``calc``, ``bench`` and ``report``.

Each defines ``add_parser(commands)``, which :mod:`lightning_tune.cli` calls; ``args`` holds what they share.
"""

__all__: list[str] = []
