"""Schemathesis against the live OpenAPI document of a real ``tidal up`` (uvicorn on loopback): every
operation, as the admin and as a tenant, a bounded number of generated requests each (the document's
examples, its coverage cases — boundaries, wrong types, missing fields, methods a path does not allow —
and random fuzzing, valid and invalid): no 500, every status and body as the document declares, a
schema-valid request accepted (or refused only for the plane's state: tests/fuzz_hooks.py), a
schema-invalid one refused. The seed is fixed so a failure reproduces; ``TIDAL_FUZZ_SEED`` and
``TIDAL_FUZZ_EXAMPLES`` widen a run by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plane_proc import Plane

pytestmark = pytest.mark.slow
CONFIG = "loop_interval_s: 3600\n"  # the reconcile loop never launches a fuzzed command
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(tmp_path_factory.mktemp("fuzz"), CONFIG)
    try:
        p.start()
        yield p
    finally:
        p.stop()


@pytest.mark.parametrize("who", ["admin", "tenant"])
def test_every_operation_answers_as_documented(plane, who, tmp_path):
    token = plane.admin.token if who == "admin" else plane.admin.create_tenant(f"fuzz-{who}")["token"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
           f"{plane.url}/openapi.json", "-H", f"Authorization: Bearer {token}", "--no-color",
           "--phases", "examples,coverage,fuzzing", "--mode", "all",
           "--max-examples", os.environ.get("TIDAL_FUZZ_EXAMPLES", "15"),
           "--seed", os.environ.get("TIDAL_FUZZ_SEED", "20261204"),
           "--exclude-checks", "positive_data_acceptance", "--generation-database", "none"]
    # in tmp_path: its cache is left there
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-5000:]
