"""Run examples/gpt/train.py as a worker of tests/dist_harness.py (same arguments, same process)."""

import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"

if __name__ == "__main__":
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
