"""The Ray executor on a real multi-node Ray cluster (tests/ray_cluster.py): ranks placed on the nodes
asked for, the torchrun contract across nodes, notices (to every rank or some) and kills, adoption by a
new executor (a restarted plane), no second copy of an attempt, release freeing Ray's GPUs."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from plane_proc import wait_until
from tidal.exec import procs
from tidal.exec.protocol import LaunchError, LaunchRequest

pytestmark = pytest.mark.slow

RANK = """
import json, os, signal, sys, time
keys = ["RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES", "TIDAL_JOB_ID", "TIDAL_PROGRESS_DIR", "TIDAL_CONTROL_FILE", "HOME", "JOB_VAR",
        "TIDAL_TEST_SECRET", "TIDAL_CKPT_URL", "TIDAL_CKPT_TIERS", "TIDAL_SHM_DIR", "TIDAL_ATTEMPT"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
time.sleep(600)
"""


def envs(ex, job: str, n: int, attempt: int = 1) -> list[dict]:
    """What each rank of the attempt printed of its environment (the log is appended across attempts)."""
    def read():
        out = []
        for r in range(n):
            log = Path(ex.log_path(job, r))
            text = log.read_text().split(f"=== tidal: {job} attempt {attempt},")[-1] if log.exists() else ""
            lines = [ln for ln in text.splitlines() if ln.startswith("ENV ")]
            if not lines:
                return None
            out.append(json.loads(lines[-1][4:]))
        return out
    return wait_until(f"the ranks of {job} to print their environment", read, 60)


def observe_until_done(ex, job: str):
    return wait_until(
        f"every rank of {job} to exit", lambda: (ob := ex.observe(time.time())[job]).done and ob, 60
    )


def gpus_free() -> float:
    import ray

    return ray.available_resources().get("GPU", 0.0)


def all_gpus_free() -> float:
    """Wait until every GPU of the cluster is free (an earlier test's placement groups are released
    asynchronously after it ended) and return their number: the tests count from there."""
    import ray

    def idle() -> float:
        total = ray.cluster_resources().get("GPU", 0.0)
        return total if total and gpus_free() == total else 0.0

    return wait_until("every GPU of the cluster free (nothing left held by an earlier test)", idle, 90)


def test_ranks_across_nodes_stop_adopt_never_twice_kill_release(ray_cluster, tmp_path, monkeypatch):
    import ray

    from tidal.exec.ray_exec import RayExecutor, _pg_name, actor_name

    ray_cluster.state_roots.append(tmp_path / "jobs")
    monkeypatch.setenv("TIDAL_TEST_SECRET", "plane-only")
    ex = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60)
    assert sorted((n.name, n.gpus) for n in ex.nodes()) == [("n1", 2), ("n2", 1), ("n3", 1)]
    total = all_gpus_free()
    cmd = (sys.executable, "-c", RANK)

    # Placement order makes the ranks: n2's GPU is rank 0 (the rendezvous), n1's two GPUs ranks 1 and 2.
    h = ex.launch(
        LaunchRequest("j", 1, cmd, {"n2": 1, "n1": 2}, env={"JOB_VAR": "x", "TIDAL_CKPT_URL": "/c/j"}),
        time.time(),
    )
    assert [(r["rank"], r["node"]) for r in h["ranks"]] == [(0, "n2"), (1, "n1"), (2, "n1")]
    e = envs(ex, "j", 3)
    assert [(x["RANK"], x["LOCAL_RANK"], x["LOCAL_WORLD_SIZE"], x["GROUP_RANK"]) for x in e] == [
        ("0", "0", "1", "0"), ("1", "0", "2", "1"), ("2", "1", "2", "1")]
    assert {x["MASTER_ADDR"] for x in e} == {h["master_addr"]} and {x["MASTER_PORT"] for x in e} == {
        str(h["master_port"])}
    assert e[0]["CUDA_VISIBLE_DEVICES"] == "0" and sorted(e[1]["CUDA_VISIBLE_DEVICES"].split(",")) == [
        "0",
        "1",
    ]
    assert e[1]["CUDA_VISIBLE_DEVICES"] == e[2]["CUDA_VISIBLE_DEVICES"]  # rank r uses cuda:LOCAL_RANK
    assert all(x["WORLD_SIZE"] == "3" and x["TIDAL_JOB_ID"] == "j" and x["JOB_VAR"] == "x" for x in e)
    assert all(x["TIDAL_ATTEMPT"] == "1" for x in e)  # the claim checked against the location's fence
    assert all(x["TIDAL_TEST_SECRET"] is None for x in e)  # a clean environment: nothing of the plane's
    assert e[0]["TIDAL_PROGRESS_DIR"] == str(tmp_path / "jobs" / "j" / "attempt-1" / "progress")
    # Across nodes: no node-memory tier (its commit needs every rank in one tier); each node its own shm dir.
    assert all(x["TIDAL_CKPT_URL"] is None and json.loads(x["TIDAL_CKPT_TIERS"]) == ["/c/j"] for x in e)
    assert [Path(x["TIDAL_SHM_DIR"]).parts[-2:] for x in e] == [("n2", "j"), ("n1", "j"), ("n1", "j")]
    wait_until("Ray to count the 3 GPUs held", lambda: gpus_free() == total - 3, 30)

    # A restarted plane (a new executor) finds the attempt by its actors' names; a notice stops every rank.
    ex2 = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60)
    assert not ex2.adopt("j", 7, time.time())  # never launched: nothing to find
    assert ex2.adopt("j", 1, time.time())
    ob = ex2.observe(time.time())["j"]
    assert [r.pid for r in ob.alive] == [r["pid"] for r in h["ranks"]] and [r.node for r in ob.ranks] == [
        "n2", "n1", "n1"]
    ex2.signal_stop("j", ranks=[1])  # a notice that reaches one rank first
    wait_until("rank 1 to take its notice", lambda: not ex2.observe(time.time())["j"].ranks[1].alive, 60)
    assert [r.exit_code for r in ex2.observe(time.time())["j"].ranks] == [None, 75, None]
    ex2.signal_stop("j")
    assert [r.exit_code for r in observe_until_done(ex2, "j").ranks] == [75, 75, 75]

    # Attempt 2 launched by yet another executor while attempt 1's actors are still there (a plane that
    # crashed before releasing): attempt 1 is removed first, never two copies in the cluster; a job whose
    # name merely starts like it keeps its actors.
    ex3 = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60)
    h3 = ex3.launch(LaunchRequest("j.a9-1", 1, cmd, {"n3": 1}), time.time())
    h2 = ex3.launch(LaunchRequest("j", 2, cmd, {"n2": 1}, env={"TIDAL_CKPT_URL": "/c/j"}), time.time())
    names = {
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ex3.namespace
    }
    assert names == {actor_name("j", 2, 0), actor_name("j.a9-1", 1, 0)}
    e = envs(ex3, "j", 1, attempt=2)[0]
    assert (
        e["CUDA_VISIBLE_DEVICES"] == "0" and e["TIDAL_CKPT_URL"] == "/c/j" and e["TIDAL_CKPT_TIERS"] is None
    )
    wait_until("Ray to count the 2 GPUs held", lambda: gpus_free() == total - 2, 30)

    # A plane killed after storing the end of j.a9-1 and before releasing it: restarted, it adopts j alone
    # and removes the rest of its own (the detached placement group would hold the GPU for good).
    ex4 = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60)
    assert ex4.adopt("j", 2, time.time())
    assert sorted(ex4.release_unadopted()) == [
        f"placement group {_pg_name(ex4.namespace, 'j.a9-1', 1)}", f"rank actor {actor_name('j.a9-1', 1, 0)}"]
    wait_until("j.a9-1's GPU back in Ray", lambda: gpus_free() == total - 1, 30)
    assert {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == ex3.namespace} == {actor_name("j", 2, 0)}
    assert ex4.release_unadopted() == []
    ex3.release("j.a9-1")  # (already gone from the cluster: the release only forgets it)
    ex3.kill("j")
    assert [r.exit_code for r in observe_until_done(ex3, "j").ranks] == [-signal.SIGKILL]
    ex3.release("j")
    wait_until("the GPUs back in Ray", lambda: gpus_free() == total, 30)
    assert not any(a["namespace"] == ex3.namespace for a in ray.util.list_named_actors(all_namespaces=True))
    wait_until("every rank process gone", lambda: not any(procs.alive(r["pid"]) for r in
                                                          h["ranks"] + h2["ranks"] + h3["ranks"]), 30)

    # Bad placements are one clear error each, and leave nothing behind.
    with pytest.raises(LaunchError, match=r"names nodes not in the Ray cluster: \['n9'\]"):
        ex3.launch(LaunchRequest("k", 1, cmd, {"n9": 1}), time.time())
    with pytest.raises(LaunchError, match="asks more GPUs than nodes have: n2 has 1"):
        ex3.launch(LaunchRequest("k", 1, cmd, {"n2": 2}), time.time())
    with pytest.raises(LaunchError, match="workdir /nonexistent"):
        ex3.launch(LaunchRequest("k", 1, cmd, {"n2": 1}, workdir="/nonexistent"), time.time())
    assert gpus_free() == total and ex3.observe(time.time()) == {}
    ex.close()


def test_leftovers_are_matched_by_whole_job_id_never_by_prefix():
    """Job names may hold dots: launching ``foo-1`` must not take ``foo-1.a2-3``'s actors for its own."""
    from tidal.exec.ray_exec import _pg_name, actor_name, attempt_of_actor, attempt_of_pg

    assert attempt_of_actor(actor_name("foo-1", 2, 0)) == ("foo-1", 2)
    assert attempt_of_actor(actor_name("foo-1.a2-3", 1, 0)) == ("foo-1.a2-3", 1)
    assert attempt_of_actor("tidal.foo-1") is None and attempt_of_actor("other.foo-1.a1.r0") is None
    assert attempt_of_pg("tidal-ab", _pg_name("tidal-ab", "foo-1.a2-3", 4)) == ("foo-1.a2-3", 4)
    assert attempt_of_pg("tidal-ab", _pg_name("tidal-xy", "foo-1", 4)) is None


def test_an_attempt_across_nodes_has_no_node_memory_tier():
    from tidal.exec.ray_exec import across_nodes

    assert across_nodes({"TIDAL_CKPT_URL": "/c", "X": "1"}) == {"TIDAL_CKPT_TIERS": '["/c"]', "X": "1"}
    tiers = json.dumps(["shm", "/nvme/r", {"url": "shm"}, {"url": "s3://b/r", "every": 5}])
    assert json.loads(across_nodes({"TIDAL_CKPT_TIERS": tiers})["TIDAL_CKPT_TIERS"]) == [
        "/nvme/r", {"url": "s3://b/r", "every": 5}]
    assert json.loads(across_nodes({"TIDAL_CKPT_TIERS": "shm,/d"})["TIDAL_CKPT_TIERS"]) == ["/d"]
    with pytest.raises(LaunchError, match="needs a tier other than node memory"):
        across_nodes({"TIDAL_CKPT_TIERS": '["shm"]'})
    assert across_nodes({}) == {} and across_nodes({"TIDAL_CKPT_TIERS": '{"a": 1}'}) == {
        "TIDAL_CKPT_TIERS": '{"a": 1}'
    }


def test_tidal_up_ray_options_bad_input_is_one_clear_error(tmp_path):
    """``tidal up --executor ...``: every wrong combination is one line naming the option, at once
    (an address nobody answers at too: ray.init alone would retry for minutes)."""
    ray = pytest.importorskip("ray")
    from tidal.control.server import build

    if ray.is_initialized():
        ray.shutdown()
    cases = [
        ({"executor": "k8s"}, "--executor must be 'local', 'ray' or 'virtual:NODESxGPUS', got 'k8s'"),
        ({"ray_address": "auto"}, "--ray-address needs --executor ray"),
        ({"ckpt_agents": True}, "--ckpt-agents needs --executor ray"),
        (
            {"executor": "ray", "ray_address": "127.0.0.1:1"},
            "cannot join the Ray cluster at 127.0.0.1:1: nothing answers there",
        ),
        ({"executor": "ray", "ray_address": "x:y"}, "--ray-address 'x:y': expected HOST:PORT"),
        (
            {"executor": "ray", "ray_address": "127.0.0.1:1", "gpus": "4"},
            "--gpus N declares the GPUs of a Ray",
        ),
    ]
    for i, (kw, msg) in enumerate(cases):
        with pytest.raises(SystemExit) as e:
            build(tmp_path / f"s{i}", kw.pop("gpus", "auto"), **kw)
        assert msg in str(e.value) and "\n" not in str(e.value), (kw, e.value)
    assert not ray.is_initialized()


def test_adopting_an_attempt_cut_short_by_a_crash_mid_launch(ray_cluster, tmp_path):
    """The plane died after recording the launch, with one rank's actor created but its command never
    started and the other's actor never created: adopted, both ranks vanished (not lost: their nodes
    are up), nothing runs; release removes the actor."""
    import ray

    from tidal.contract import LAUNCH_FILE
    from tidal.exec.files import write_json
    from tidal.exec.ray_exec import RayExecutor, actor_name

    ex = RayExecutor(tmp_path / "jobs", address=ray_cluster.address, ready_timeout_s=60)
    all_gpus_free()
    ex.nodes()
    adir = ex.attempt_dir("m", 1)
    adir.mkdir(parents=True)
    write_json(
        adir / LAUNCH_FILE,
        {
            "job_id": "m",
            "attempt": 1,
            "launched_s": time.time(),
            "ranks": [
                {"rank": r, "node": n, "node_id": ex._ids[n], "actor": actor_name("m", 1, r)}
                for r, n in enumerate(["n2", "n3"])
            ],
        },
    )
    a = ex._remote.options(name=actor_name("m", 1, 0), namespace=ex.namespace, lifetime="detached",
                           num_cpus=0).remote()
    ray.get(a.info.remote(), timeout=60)
    assert ex.adopt("m", 1, time.time())
    ob = wait_until("both ranks vanished", lambda: (o := ex.observe(time.time())["m"]).done and o, 30)
    assert [(r.vanished, r.lost, r.exit_code) for r in ob.ranks] == [(True, False, None), (True, False, None)]
    ex.release("m")

    # A command that cannot start on the node: exit code 127 and the reason in the rank's log.
    ex.launch(LaunchRequest("q", 1, ("/nonexistent/python", "-c", "pass"), {"n2": 1}), time.time())
    ob = wait_until("the rank's end", lambda: (o := ex.observe(time.time())["q"]).done and o, 30)
    assert [r.exit_code for r in ob.ranks] == [127] and "cannot start '/nonexistent/python'" in Path(
        ex.log_path("q", 0)).read_text()
    ex.release("q")
    wait_until(
        "the actor gone",
        lambda: (
            not any(x["namespace"] == ex.namespace for x in ray.util.list_named_actors(all_namespaces=True))
        ),
        30,
    )


def test_node_memory_of_jobs_is_listed_and_freed_on_each_node(ray_cluster, tmp_path):
    """The plane's sweep (the NodeMemory protocol) reaches every node through tasks pinned there: the
    jobs' directories are listed (never the checkpoint agent's, never a symbolic link) and freed."""
    from tidal.exec.isolation import IsolationConfig
    from tidal.exec.protocol import NodeMemory
    from tidal.exec.ray_exec import RayExecutor

    base = tmp_path / "shm"
    ex = RayExecutor(tmp_path / "jobs", address=ray_cluster.address,
                     isolation=IsolationConfig(shm_dir=str(base)))
    assert isinstance(ex, NodeMemory)
    for node, job in [("n1", "old-1"), ("n2", "old-1"), ("n3", "other-2"), ("n1", "agent")]:
        (base / node / job).mkdir(parents=True)
        (base / node / job / "data").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"y")
    (base / "n2" / "link-3").symlink_to(outside)
    # A node slow to answer (a cold worker on a busy machine) is asked again at the next sweep.
    wait_until("every node's listing", lambda: ex.shm_jobs() == ["old-1", "other-2"], 60)
    assert ex.free_shm("old-1")
    wait_until("old-1 freed on n1 and n2", lambda: not (base / "n1" / "old-1").exists()
               and not (base / "n2" / "old-1").exists(), 60)
    assert (base / "n3" / "other-2" / "data").exists() and (base / "n1" / "agent" / "data").exists()
    wait_until("a listing without old-1", lambda: ex.shm_jobs() == ["other-2"], 60)
    assert not ex.free_shm("link-3") and (outside / "keep").exists()
    ex.close()
