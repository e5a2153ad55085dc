"""Tidal's lab: what the team ran to choose a design, kept apart from the product (``src/tidal``).

Not in the wheel. Run from the repository root: ``python -m lab --help`` for the studies with a command,
``python lab/<script>.py`` for the others; lab/README.md lists every experiment, its command and its
result. The lab imports ``tidal``; ``tidal`` never imports the lab. This package's ``__init__`` imports
nothing: the peer adapters run ``python -m lab.peers.<adapter>`` in venvs holding only torch and one engine.
"""
