"""The Ray executor: the ranks of a job run on the nodes of a Ray cluster (``tidal up --executor ray``).

Training nodes are the cluster's alive nodes with ``GPU`` resources (:meth:`RayExecutor.nodes`, asked on
every call); an attempt is one placement group with a ``{"GPU": 1}`` bundle per rank, pinned to the
chosen nodes, and one detached, named actor per rank (:class:`tidal.exec.ray_rank.RankActor`), so a
restarted plane re-adopts it by name. Node memory, checkpoint agents, isolation and the environment
contract: docs/control.md, The Ray executor. The state dir must be on a filesystem every node mounts.
Not thread-safe: one reconcile loop drives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal import contract as c
from tidal.contract import torchrun_env
from tidal.exec import ray_checks, sandbox
from tidal.exec.files import Attempt, AttemptDirs, read_json, write_json
from tidal.exec.isolation import (
    AUTO,
    IsolationConfig,
    Uids,
    check_reachable,
    clean_env,
    prepare_attempt,
    private_dir,
    rank_rlimits,
    recorded_owner,
    require_root,
)
from tidal.exec.protocol import LaunchError, LaunchRequest, Observation
from tidal.exec.ray_auth import enable_local, use_token_from_env
from tidal.exec.ray_checks import (
    check_auth,
    check_reachable_address,
    check_workers_root,
    join_error,
    workers_root,
)
from tidal.exec.ray_names import (  # what the plane's objects are called on the cluster, where they live
    _pg_name,
    across_nodes,
    actor_name,
    agent_namespace,
    attempt_of_actor,
    attempt_of_pg,
    kill_ranks,
    namespace_for,
    rank_pids,
    shm_base,
)
from tidal.exec.ray_rank import RankActor
from tidal.model import Node

log = logging.getLogger(__name__)

NODE_LABEL = c.RAY_NODE_LABEL  # a node's name for Tidal, when set (else ray-<node id prefix>)
NODE_ID_LABEL = "ray.io/node-id"  # Ray's own label of every node: what bundles are pinned with
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}  # nothing calls home
POLL_TIMEOUT_S = 0.5  # one step waits this long at most for the ranks' answers
READY_TIMEOUT_S = 120.0  # placement group reserved and actors up, or the launch fails
END_TIMEOUT_S = 5.0  # a release waits this long at most for the actors to kill what their ranks left


@dataclass
class _Rank:
    rank: int
    node: str
    node_id: str
    actor: Any | None  # None: not found (never created, or gone)
    pid: int | None = None
    inflight: Any | None = None  # an unanswered poll


def _spawned(k: _Rank) -> Any:
    """The actor of a rank the launch just created (set there: never None)."""
    assert k.actor is not None
    return k.actor


@dataclass
class _Tracked(Attempt):
    pg_id: str | None = None  # lost: ranks whose node left the cluster


class RayExecutor(AttemptDirs):
    """Runs ranks as processes under rank actors on a Ray cluster. See the module docstring.

    ``address``: the cluster to join (``"auto"``, ``"HOST:PORT"``, ``"ray://..."``); ``None`` starts a
    local Ray (with ``num_gpus`` GPUs declared, if given) unless ``RAY_ADDRESS`` names one."""

    isolation: IsolationConfig

    def __init__(self, root: str | os.PathLike, *, address: str | None = None, num_gpus: int | None = None,
                 isolation: IsolationConfig | None = None, namespace: str | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S, ckpt_agents: bool = False,
                 serving_nodes: Mapping[str, int] | None = None,
                 hidden: Collection[str | os.PathLike] = ()) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.serving_nodes = dict(serving_nodes or {})
        self.isolation = iso = isolation or IsolationConfig()
        require_root(iso)
        if iso.max_memory_bytes not in (None, AUTO):  # a limit asked for is never dropped silently
            raise ValueError("isolation.max_memory_bytes: the Ray executor sets no memory cgroups (the local "
                             "executor does); remove it")
        self.root = Path(root)
        self.hidden = [str(Path(p).resolve()) for p in (root, *hidden)]  # no rank sees them (but its own)
        through = iso.uid_base is not None and not iso.sandboxed  # uids pass through to their directories
        private_dir(self.root, 0o711 if through else 0o700)
        self.uids = Uids(self.root / ".uids.json", iso.uid_base) if iso.uid_base is not None else None
        self.namespace = namespace or namespace_for(self.root)
        self.shm_root = shm_base(self.namespace, iso.shm_dir)
        if through:
            check_reachable(self.root.resolve(), *([Path(iso.shm_dir).absolute()] if iso.shm_dir else []))
        for k, v in QUIET_ENV.items():
            os.environ.setdefault(k, v)
        use_token_from_env()
        import ray

        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            check_reachable_address(address)
            kw: dict[str, Any] = {}
            if address is None and not os.environ.get("RAY_ADDRESS"):
                kw = {"include_dashboard": False, **({"num_gpus": num_gpus} if num_gpus is not None else {})}
                if not use_token_from_env():  # the Ray it starts refuses clients without its token
                    enable_local(self.root.parent / "ray-auth")
            try:
                ray.init(address=address, namespace=self.namespace, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False, **kw)
            except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as e:
                raise join_error(address, e) from None
            self._owns_ray = True
        self.address = address
        self._remote = ray.remote(RankActor)
        self._ids: dict[str, str] = {}  # node name -> Ray node id (of the newest nodes() call)
        self._jobs: dict[str, _Tracked] = {}
        self._shm_where: dict[str, list[str]] = {}  # job -> nodes with its node memory (last shm_jobs)
        self.agents = None
        try:
            # a cluster without a token runs any job's code as its workers' user, outside every sandbox
            self.token_auth = check_auth(ray, iso.sandboxed, iso.ray_open_cluster)
            if self.uids is not None:  # asked of a worker on each node, never assumed
                check_workers_root(ray, self._read_nodes()[1])
            # as locally, a uid per tenant by default where the plane and every node's workers are root
            own = (self.uids is None and iso.sandboxed and os.geteuid() == 0
                   and workers_root(ray, self._read_nodes()[1]))
            self.isolation = iso = iso.resolved(self.root, uids=own)
            if own and iso.uid_base is not None:
                self.uids = Uids(self.root / ".uids.json", iso.uid_base)
            if iso.sandboxed:
                code = sandbox.code_paths({}, [], sys.executable)  # the plane's: the same paths on each node
                ray_checks.check_sandbox(ray, self._read_nodes()[1], code)
            if ckpt_agents:
                if self.shm_root is None:
                    raise ValueError("checkpoint agents on Ray nodes need /dev/shm (or isolation.shm_dir)")
                from tidal.ckpt.agent.auth import load_or_create_key
                from tidal.exec.ray_agents import RayAgents

                self.agents = RayAgents(ray, self.namespace, self.shm_root, self.root,
                                        uids=self.uids is not None, key=load_or_create_key(self.root))
        except ValueError:
            self.close()
            raise

    def close(self) -> None:
        """Disconnect from Ray (a local Ray this executor started ends, detached actors do not)."""
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False

    # -- the cluster ---------------------------------------------------------------------------------
    def _alive(self) -> list[dict]:
        return [n for n in self._ray.nodes() if n.get("Alive")]

    def nodes(self) -> list[Node]:
        out, ids = self._read_nodes()
        self._ids = ids
        if self.agents is not None:
            self.agents.ensure(ids)
        return out

    def _read_nodes(self) -> tuple[list[Node], dict[str, str]]:
        """The alive GPU nodes and node name -> Ray node id (see the module docstring)."""
        out, ids = [], {}
        for n in sorted(self._alive(), key=lambda n: n["NodeID"]):
            gpus = int(n.get("Resources", {}).get("GPU", 0))
            if gpus < 1:
                continue
            name = (n.get("Labels") or {}).get(NODE_LABEL) or f"ray-{n['NodeID'][:12]}"
            if name in ids:
                log.warning("two Ray nodes carry the label %s=%s; naming the second by its id",
                            NODE_LABEL, name)
                name = f"ray-{n['NodeID'][:12]}"
            ids[name] = n["NodeID"]
            out.append(Node(name, gpus, "serving" if name in self.serving_nodes else "training"))
        return out, ids

    def check_serving(self, tolerate: Collection[str] = ()) -> None:
        """``ValueError`` in one line when a serving node is not an alive GPU node of the cluster or has
        other GPUs there than the serving side says; nodes in ``tolerate`` may (lost while the plane was
        down)."""
        have = {n.name: n.gpus for n in self._read_nodes()[0]}  # no agents started for a plane that won't run
        ray_checks.check_serving(self.serving_nodes, have, tolerate)

    def used(self) -> dict[str, int]:
        """Node -> GPUs held by tracked attempts (launched and not yet released), by their ranks' bundles."""
        return dict(Counter(k.node for t in self._jobs.values() for k in t.ranks))

    # -- acting --------------------------------------------------------------------------------------
    def launch(self, req: LaunchRequest, now_s: float) -> dict:
        if req.job_id in self._jobs:
            raise LaunchError(f"job {req.job_id}: attempt {self._jobs[req.job_id].attempt} is still tracked")
        have = {n.name: n.gpus for n in self.nodes()}
        unknown = sorted(set(req.placement) - set(have))
        if unknown:
            raise LaunchError(f"job {req.job_id}: placement {dict(req.placement)} names nodes not in the Ray "
                              f"cluster: {unknown} (have {sorted(have)})")
        over = {n: k for n, k in req.placement.items() if k > have[n]}
        if over:
            raise LaunchError(f"job {req.job_id}: placement {dict(req.placement)} asks more GPUs than nodes "
                              "have: " + ", ".join(f"{n} has {have[n]}" for n in over))
        if req.workdir is not None and not Path(req.workdir).is_dir():
            raise LaunchError(f"job {req.job_id}: workdir {req.workdir} is not a directory")
        adir = self.attempt_dir(req.job_id, req.attempt)
        try:
            owner = self.uids.owner(self.isolation.per, req.job_id, req.tenant) if self.uids else None
            prepare_attempt(self.root, self.job_dir, adir, self.home_dir(req.job_id), req, owner, self.uids,
                            self.hidden if self.isolation.sandboxed else None)
        except (OSError, RuntimeError) as e:
            raise LaunchError(f"job {req.job_id}: cannot prepare its directories: {e}") from e
        self._remove_leftovers(req.job_id)
        plan = [(node, self._ids[node]) for node, k in req.placement.items() for _ in range(k)]
        from ray.util.placement_group import placement_group

        pg = placement_group([{"GPU": 1} for _ in plan], strategy="PACK", lifetime="detached",
                             name=_pg_name(self.namespace, req.job_id, req.attempt),
                             bundle_label_selector=[{NODE_ID_LABEL: nid} for _, nid in plan])
        doc = {"job_id": req.job_id, "attempt": req.attempt, "world_size": len(plan), "launched_s": now_s,
               "placement": dict(req.placement), "namespace": self.namespace, "placement_group": pg.id.hex(),
               "owner": list(owner) if owner else None,
               "ranks": [{"rank": r, "node": node, "node_id": nid,
                          "actor": actor_name(req.job_id, req.attempt, r)}
                         for r, (node, nid) in enumerate(plan)]}
        write_json(adir / c.LAUNCH_FILE, doc)  # before any actor exists: a restarted plane finds them all
        ranks: list[_Rank] = []
        try:
            handle = self._start(req, adir, plan, pg, ranks, doc, owner)
        except BaseException as e:
            self._kill_actors([k.actor for k in ranks])
            self._remove_pg(pg)
            if isinstance(e, LaunchError | KeyboardInterrupt | SystemExit):
                raise
            raise LaunchError(f"job {req.job_id}: cannot start on Ray: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from e
        self._jobs[req.job_id] = _Tracked(req.job_id, req.attempt, now_s, adir, ranks, owner,
                                          pg_id=pg.id.hex())
        return handle

    def _start(self, req: LaunchRequest, adir: Path, plan: list[tuple[str, str]], pg: Any, ranks: list[_Rank],
               doc: dict, owner: tuple[int, int] | None) -> dict:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        try:
            ray.get(pg.ready(), timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"job {req.job_id}: Ray could not reserve {dict(req.placement)} within "
                              f"{self.ready_timeout_s:g} s (GPUs held outside Tidal?)") from None
        for r, (node, nid) in enumerate(plan):
            actor = self._remote.options(
                name=actor_name(req.job_id, req.attempt, r), namespace=self.namespace, lifetime="detached",
                num_cpus=0, num_gpus=1, max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
            ).remote()
            ranks.append(_Rank(r, node, nid, actor))
        infos = ray.get([_spawned(k).info.remote() for k in ranks], timeout=self.ready_timeout_s)
        for k, info in zip(ranks, infos, strict=True):
            if info["node_id"] != k.node_id:  # never expected: the bundle is pinned to the node
                raise LaunchError(
                    f"job {req.job_id}: rank {k.rank} landed on Ray node {info['node_id'][:12]}, "
                    f"not on {k.node}"
                )
        port = ray.get(_spawned(ranks[0]).free_port.remote(), timeout=self.ready_timeout_s)
        master = infos[0]["ip"]
        on_node: dict[str, list[int]] = {}
        for k in ranks:
            on_node.setdefault(k.node, []).append(k.rank)
        groups = list(on_node)
        job_env = across_nodes(req.env) if len(groups) > 1 else dict(req.env)
        starts = []
        n = len(ranks)
        token = self.agents.token(agent_namespace(req.env, req.job_id)) if self.agents is not None else None
        rlimits = rank_rlimits(self.isolation, owner)
        for k in ranks:
            local = on_node[k.node]
            gpus = ",".join(g for r in local for g in infos[r]["gpu_ids"])
            platform = {**torchrun_env(k.rank, n, port, master_addr=master, local_rank=local.index(k.rank),
                                       local_world_size=len(local), group_rank=groups.index(k.node)),
                        **self.attempt_env(req, adir), c.ENV_CUDA_VISIBLE_DEVICES: gpus}
            shm = str(self.shm_root / k.node / req.job_id) if self.shm_root is not None else None
            base = {c.ENV_SHM_DIR: shm} if shm is not None else {}
            if self.agents is not None:
                base.update(self.agents.env(k.node))
                if token is not None:
                    platform[c.ENV_CKPT_AGENT_TOKEN] = token
            env = clean_env(self.isolation, self.home_dir(req.job_id), job_env, platform,
                            omp_threads=(os.cpu_count() or 1) // max(1, len(local)), base=base)
            header = (f"=== tidal: {req.job_id} attempt {req.attempt}, rank {k.rank} of {n} on {k.node}, "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
            cwd = req.workdir or str(self.home_dir(req.job_id))
            starts.append(_spawned(k).start.remote(
                list(req.command), env, cwd, self.log_path(req.job_id, k.rank), header,
                str(adir / c.pid_file(k.rank)), owner, rlimits,
                shm if c.ENV_SHM_DIR not in job_env or self.isolation.sandboxed else None,
                self.binds(req, adir, env, cwd, shm, gpu=True) if self.isolation.sandboxed else None))
        for k, pid in zip(ranks, ray.get(starts, timeout=self.ready_timeout_s), strict=True):
            k.pid = pid
        doc = {**doc, "master_addr": master, "master_port": port,
               "ranks": [{**d, "pid": k.pid, "gpu_ids": infos[k.rank]["gpu_ids"]}
                         for d, k in zip(doc["ranks"], ranks, strict=True)]}
        write_json(adir / c.LAUNCH_FILE, doc)
        return {"executor": "ray", "placement": dict(req.placement), "master_addr": master,
                "master_port": port, "dir": str(adir), **({"uid": owner[0]} if owner else {}),
                "placement_group": doc["placement_group"],
                "ranks": [{"rank": k.rank, "pid": k.pid, "node": k.node, "gpu_ids": infos[k.rank]["gpu_ids"]}
                          for k in ranks]}

    def _remove_leftovers(self, job_id: str) -> None:
        """Actors and placement groups of the job's earlier attempts that are still in the cluster (a
        plane that crashed mid-launch, a release that did not reach Ray): removed, never run twice."""
        self._remove_where(lambda job, _: job == job_id)

    def release_unadopted(self) -> list[str]:
        """After a restart's adoptions: remove the actors and placement groups of this plane's attempts
        that it does not track (an attempt whose end a plane killed before its release had stored: its
        detached placement group would hold the GPUs for good; a launch cut short before it was recorded)."""
        tracked = {(t.job_id, t.attempt) for t in self._jobs.values()}
        return self._remove_where(lambda job, attempt: (job, attempt) not in tracked)

    def _remove_where(self, which: Callable[[str, int], bool]) -> list[str]:
        """Remove this namespace's rank actors and placement groups whose (job, attempt) ``which`` picks;
        what was removed, named (each logged)."""
        ray, out = self._ray, []
        for a in ray.util.list_named_actors(all_namespaces=True):
            name = str(a.get("name", ""))
            if a.get("namespace") == self.namespace and (of := attempt_of_actor(name)) and which(*of):
                with contextlib.suppress(ValueError):
                    self._kill_actors([ray.get_actor(name, namespace=self.namespace)])
                    out.append(f"rank actor {name}")
        for pg_id, info in ray.util.placement_group_table().items():
            name = str(info.get("name", ""))
            if info.get("state") != "REMOVED" and (of := attempt_of_pg(self.namespace, name)) and which(*of):
                self._remove_pg_id(pg_id)
                out.append(f"placement group {name}")
        for what in out:
            log.warning("removed the leftover %s", what)
        return out

    def _kill_actors(self, actors: list[Any], lost: Sequence[Any] = ()) -> None:
        """End what each rank left (:meth:`~tidal.exec.ray_rank.RankActor.end`, all at once, waited for up
        to ``END_TIMEOUT_S``: a worker's death alone would leave the processes a rank detached to init;
        not asked of the ``lost`` ones, whose node left), then the actors."""
        actors = [a for a in actors if a is not None]
        with contextlib.suppress(Exception):
            if asked := [a.end.remote() for a in actors if not any(a is x for x in lost)]:
                self._ray.wait(asked, num_returns=len(asked), timeout=END_TIMEOUT_S)
        for a in actors:
            with contextlib.suppress(Exception):
                self._ray.kill(a, no_restart=True)

    def _remove_pg(self, pg: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(pg)

    def _remove_pg_id(self, pg_id: str) -> None:
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        with contextlib.suppress(Exception):
            self._remove_pg(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))

    def _send(self, t: _Tracked, ranks: list[_Rank], sig: int) -> None:
        for k in ranks:
            if k.actor is not None:
                k.actor.signal.remote(int(sig))  # not waited for: observe() sees the rank exit

    def release(self, job_id: str) -> None:
        t = self._jobs.pop(job_id, None)
        if t is None:
            return
        self._kill_actors([k.actor for k in t.ranks], [k.actor for k in t.ranks if k.rank in t.lost])
        if t.pg_id:
            self._remove_pg_id(t.pg_id)

    # -- observing -----------------------------------------------------------------------------------
    def observe(self, now_s: float) -> dict[str, Observation]:
        if not self._jobs:
            return {}
        ray = self._ray
        alive = {n["NodeID"] for n in self._alive()}
        asked = []
        for t in self._jobs.values():
            for k in t.ranks:
                if k.rank in t.codes or k.rank in t.vanished:
                    continue
                if k.node_id not in alive:  # the node left the cluster: the rank went with it
                    t.vanished.add(k.rank)
                    t.lost.add(k.rank)
                elif k.actor is None:
                    t.vanished.add(k.rank)
                else:
                    if k.inflight is None:
                        k.inflight = k.actor.poll.remote()
                    asked.append((t, k))
        if asked:
            ray.wait([k.inflight for _, k in asked], num_returns=len(asked), timeout=POLL_TIMEOUT_S)
        for t, k in asked:
            ready, _ = ray.wait([k.inflight], timeout=0)
            if not ready:
                continue  # no answer yet: still running as far as anyone knows
            ref, k.inflight = k.inflight, None
            try:
                res = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue  # unreachable for now (restarting, network): asked again next step
            except ray.exceptions.RayActorError:
                t.vanished.add(k.rank)  # the actor died (with its node, or killed from outside)
                if k.node_id not in {n["NodeID"] for n in self._alive()}:
                    t.lost.add(k.rank)
                continue
            k.pid = res.get("pid") or k.pid
            if not res.get("started"):
                t.vanished.add(k.rank)  # its actor exists but the launch never got to start it
            elif res.get("code") is not None:
                t.codes[k.rank] = int(res["code"])
        for t in self._jobs.values():
            self.cap_logs(t, self.isolation.max_log_bytes)
        return {job_id: t.observation(across_nodes=True) for job_id, t in self._jobs.items()}

    # -- node memory (the NodeMemory protocol; tasks on the nodes: tidal.exec.ray_shm) -----------------
    def shm_jobs(self) -> list[str]:
        """Jobs with a node-memory directory on an alive node (asked of each node)."""
        if self.shm_root is None:
            return []
        from tidal.exec import ray_shm

        self.nodes()  # the alive nodes' ids, fresh
        self._shm_where = ray_shm.shm_jobs(self._ray, self._ids, self.shm_root)
        return sorted(self._shm_where)

    def free_shm(self, job_id: str) -> bool:
        """Remove the job's node-memory directories where the last ``shm_jobs`` saw them (never tracked)."""
        where = self._shm_where.pop(job_id, None)
        if self.shm_root is None or job_id in self._jobs or not where:
            return False
        from tidal.exec import ray_shm

        return ray_shm.free(self._ray, self._ids, self.shm_root, job_id, where)

    # -- the agents' memory of jobs (the AgentMemory protocol: tidal.exec.agent_memory) ----------------
    def agent_jobs(self) -> list[str]:
        return self.agents.held_jobs() if self.agents is not None else []

    def free_agent_job(self, namespace: str) -> bool:
        return self.agents is not None and self.agents.free_job(namespace)

    def worker_pids(self, job_id: str) -> dict[int, int]:
        """rank -> the rank's pid on its node, for those that started."""
        t = self._jobs.get(job_id)
        return {k.rank: k.pid for k in (t.ranks if t else []) if k.pid is not None}

    # -- recovery ------------------------------------------------------------------------------------
    def adopt(self, job_id: str, attempt: int, now_s: float) -> bool:
        """Track attempt ``attempt`` again: its actors found by name (a rank whose actor is gone is
        reported vanished); False without its ``launch.json`` (no actor of it was ever created)."""
        adir = self.attempt_dir(job_id, attempt)
        doc = read_json(adir / c.LAUNCH_FILE)
        if doc is None or not isinstance(doc.get("ranks"), list):
            return False
        ranks = []
        for d in doc["ranks"]:
            try:
                actor = self._ray.get_actor(str(d["actor"]), namespace=self.namespace)
            except ValueError:
                actor = None
            ranks.append(_Rank(int(d["rank"]), str(d["node"]), str(d["node_id"]), actor, d.get("pid")))
        self._jobs[job_id] = _Tracked(job_id, attempt, float(doc["launched_s"]), adir, ranks,
                                      recorded_owner(doc), pg_id=doc.get("placement_group"))
        return True


__all__ = ["NODE_LABEL", "RayExecutor", "actor_name", "kill_ranks", "rank_pids"]
