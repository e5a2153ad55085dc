"""Checkpoint benchmark; the same as ``tidal bench ckpt`` (see ``tidal.bench.ckpt``).

    python benchmarks/ckpt.py --size-gb 1 --repeat 5 [--json] [--dir DIR]
"""

from tidal.bench.cli import main

if __name__ == "__main__":
    main()
