"""The steps checkpoint agents keep of ended jobs (the peer tier) are freed by the control plane's sweep,
as node memory is (``Controller.sweep_shm`` -> ``node_memory.sweep_agents``): two real agent processes
on loopback, each the other's buddy, and the controller with a fake executor whose agents' memory is
those agents (``tidal.exec.agent_memory``, the ``AgentMemory`` seam). A job whose newest step is also on
its disk is freed at once, from both agents (its own copy and the buddy's replica); one whose newest
step is only in the agents after ``isolation.shm_retention_s``; a running job and a namespace no job
of the plane names are left alone."""

from __future__ import annotations

import dataclasses
import time

import pytest

from control_fakes import FakeClock, FakeExecutor, new_store, submit
from tidal.ckpt.agent.proc import AgentProcess
from tidal.ckpt.tiers.peer import AgentClient
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.node_memory import agent_namespaces
from tidal.exec import agent_memory

RETENTION_S = 30.0


class AgentsExecutor(FakeExecutor):
    """The fake executor (our seam) with real checkpoint agents' memory."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(gpus=4)
        self.addresses = addresses

    def agent_jobs(self) -> list[str]:
        return sorted(agent_memory.held_jobs(self.addresses))

    def free_agent_job(self, namespace: str) -> bool:
        return agent_memory.free_job(self.addresses, namespace) > 0


@pytest.fixture
def agents(tmp_path, monkeypatch):
    monkeypatch.delenv("TIDAL_CKPT_AGENT", raising=False)
    a, b = (AgentProcess(tmp_path / f"mem-{n}", node=n, resync_s=0.2) for n in "ab")
    a.buddy, b.buddy = b.address, a.address
    try:
        yield a.start(), b.start()
    finally:
        a.stop()
        b.stop()


def held(ag: AgentProcess) -> dict[str, set[tuple[int, str]]]:
    """namespace -> {(step, own|replica)} at one agent."""
    out: dict[str, set[tuple[int, str]]] = {}
    for r in ag.status()["steps"]:
        out.setdefault(r["job"], set()).add((r["step"], r["from"]))
    return out


def test_ended_jobs_steps_leave_the_agents_after_their_retention(agents, tmp_path):
    a, b = agents
    store = new_store(tmp_path, ("lab", 0, 1.0))
    ex = AgentsExecutor([a.address, b.address])
    cfg = ControlConfig(isolation=dataclasses.replace(ControlConfig().isolation, shm_retention_s=RETENTION_S))
    ctl, clock = Controller(store, ex, cfg, ckpt_root=tmp_path / "jobs"), FakeClock()
    spec = {n: {"tiers": ["peer", {"url": str(tmp_path / n), "every": 3}]} for n in ("only", "disk", "runs")}
    ids = {n: submit(store, "lab", clock(), name=n, checkpoint=spec[n]) for n in spec}
    ns = {n: next(iter(agent_namespaces(store.job(ids[n]).spec))) for n in spec}
    client = AgentClient(a.address, timeout_s=10)
    for name in [*ns.values(), "stranger"]:  # steps 10 and 20 of each, at agent a (pushed on to b)
        for step in (10, 20):
            path = f"/v1/jobs/{name}/step_{step:012d}"
            assert client.request("PUT", f"{path}/r00000-x.safetensors", body=b"x" * 1000)[0] == 200
            assert client.request("PUT", f"{path}/manifest.json", body=b"{}")[0] == 200
    want = {n: {(10, "replica"), (20, "replica")} for n in [*ns.values(), "stranger"]}
    deadline = time.monotonic() + 30  # every step's push on, not only every namespace's first
    while held(b) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held(b) == want

    ctl.step(clock())
    ctl.step(clock.advance(1))
    t = clock()
    ex.beat(ids["only"], t, 25, ckpt_step=20, tiers={"peer": [20, t], "disk": [10, t]})
    ex.beat(ids["disk"], t, 25, ckpt_step=20, tiers={"peer": [20, t], "disk": [20, t]})
    ex.beat(ids["runs"], t, 25, ckpt_step=20, tiers={"peer": [20, t]})
    ctl.step(clock.advance(1))
    ex.exit(ids["only"], 0)
    ex.exit(ids["disk"], 0)
    ctl.step(clock.advance(1))
    states = [store.job(ids[n]).state for n in ("only", "disk", "runs")]
    assert states == ["succeeded", "succeeded", "running"]

    ctl.sweep_shm(clock(), force=True)  # the newest step of "disk" is on its disk: freed at once, everywhere
    for ag in (a, b):
        assert set(held(ag)) == {ns["only"], ns["runs"], "stranger"}, held(ag)
    assert [e.message for e in store.events(job_id=ids["disk"]) if e.kind == "agent_freed"] == [
        f"checkpoint agents' memory ({ns['disk']}) freed: succeeded; its newest checkpoint (step 20) is "
        "also in tier disk"]

    ctl.sweep_shm(clock.advance(RETENTION_S - 5), force=True)  # within the retention: kept
    assert set(held(a)) == {ns["only"], ns["runs"], "stranger"}
    ctl.sweep_shm(clock.advance(10), force=True)  # past it: freed; the running job and the stranger stay
    for ag in (a, b):
        assert set(held(ag)) == {ns["runs"], "stranger"}, held(ag)
    assert "step 20 was only in the agents' memory" in " ".join(
        e.message for e in store.events(job_id=ids["only"]) if e.kind == "agent_freed")
    store.close()
