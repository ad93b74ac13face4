"""The ``lightning-tune`` commands, one module each: ``demo``, ``calc``, ``bench`` and ``report``.

Each defines ``add_parser(commands)``, which builds its sub-parser and sets its handler; :mod:`lightning_tune.cli`
registers them. :mod:`lightning_tune.commands.args` holds what they share.
"""

__all__: list[str] = []
