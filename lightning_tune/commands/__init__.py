"""Sub-commands of ``lightning-tune`` that live in modules of their own.

Each module defines ``add_parser(commands)``, which builds its sub-parser and sets the handler;
:mod:`lightning_tune.cli` registers them. Nothing here is public API.
"""

__all__: list[str] = []
