"""The lab's tests import ``lab`` from the repository root, however pytest is started (``make test``
runs ``pytest tests lab/tests`` from there; ``pytest lab/tests`` alone works too)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)
