"""The contract between the runtime (tidal.train), the executors (tidal.exec) and the control plane
(tidal.control) holds end to end: what the controller and the local executor put into a rank's
environment is what the runtime's parser reads, the files the runtime writes are the ones the
executor reads, and every side uses the same exit code and default grace (tidal.contract)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from control_fakes import FakeClock, FakeExecutor, new_store, submit
from tidal import contract
from tidal.control.config import ControlConfig
from tidal.control.controller import Controller
from tidal.control.spec import JobSpec
from tidal.exec.local import LocalExecutor
from tidal.policy.loan import LoanTiming
from tidal.policy.scheduler import SchedulerConfig

DUMP_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


def launch_env(tmp_path: Path, **spec) -> tuple[LocalExecutor, str, list[dict[str, str]]]:
    """Submit a job, let the controller build its launch request, run that on the local executor with
    a command that prints each rank's environment; returns (executor, job id, each rank's env)."""
    store = new_store(tmp_path, ("lab", 0, 1.0))
    fake = FakeExecutor(gpus=2)
    ctl = Controller(store, fake, ControlConfig(), ckpt_root=tmp_path / "ckpt")
    clock = FakeClock()
    job = submit(store, "lab", clock(), name="c", gpus=2, **spec)
    ctl.step(clock())
    req = fake.jobs[job].req
    store.close()
    ex = LocalExecutor(tmp_path / "jobs", slots=2)
    ex.launch(replace(req, command=(sys.executable, "-c", DUMP_ENV), placement={"local": 2}), time.time())
    deadline = time.monotonic() + 30
    while not ex.observe(time.time())[job].done:
        assert time.monotonic() < deadline, "ranks still running after 30 s"
        time.sleep(0.05)
    envs = []
    for r in range(2):
        lines = Path(ex.log_path(job, r)).read_text().splitlines()
        envs.append(json.loads(lines[1]))
    return ex, job, envs


def test_the_runtime_reads_what_the_controller_and_the_executor_set(tmp_path):
    from tidal.train.env import Env
    from tidal.train.progress import Heartbeat, JsonlWriter, heartbeat_path, progress_path

    ex, job, envs = launch_env(tmp_path, checkpoint={"interval_s": 300})
    adir = ex.attempt_dir(job, 1)
    for r, raw in enumerate(envs):
        env = Env.from_environ(raw)
        assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (r, 2, r, 2)
        assert env.launched and env.master_addr == "127.0.0.1"
        assert env.job_id == job and env.grace_s == contract.DEFAULT_GRACE_S and env.ckpt_interval_s == 300
        assert env.ckpt_url == str(tmp_path / "ckpt" / job / "ckpt")
        assert env.progress_dir == str(adir / contract.PROGRESS_DIRNAME)
        assert env.control_file == str(adir / contract.CONTROL_FILE)
        assert raw[contract.ENV_CUDA_VISIBLE_DEVICES] == ""
        # the runtime's progress files, where the env says, are what the executor reads
        Heartbeat(heartbeat_path(env.progress_dir, env.rank), rank=env.rank).beat(7, "train", 0.5, force=True)
        if r == 0:
            w = JsonlWriter(progress_path(env.progress_dir, 0))
            w.write({"event": "step", "step": 7, "time": time.time(), "loss": 1.5})
            w.close()
    p = ex.observe(time.time())[job].progress
    assert (p.heartbeats, p.step, p.loss, p.phase) == (2, 7, 1.5, "train")
    # a setting the executor changes reaches the file the runtime re-reads
    ex.configure(job, {"ckpt_interval_s": 60})
    assert json.loads(Path(Env.from_environ(envs[1]).control_file).read_text()) == {"ckpt_interval_s": 60}
    ex.release(job)


def test_tiers_and_grace_from_the_spec_reach_the_runtime(tmp_path):
    from tidal.train.env import Env

    _, _, envs = launch_env(tmp_path, grace_s=12.5, checkpoint={"tiers": ["shm", str(tmp_path / "d")]})
    env = Env.from_environ(envs[0])
    assert env.grace_s == 12.5 and env.ckpt_tiers == ("shm", str(tmp_path / "d")) and env.ckpt_url is None


def test_platform_variables_are_reserved():
    """Everything the executor and the controller always set is off limits to a job's spec."""
    always = {contract.ENV_JOB_ID, contract.ENV_PROGRESS_DIR, contract.ENV_CONTROL_FILE, contract.ENV_GRACE_S,
              contract.ENV_CKPT_INTERVAL_S, contract.ENV_CUDA_VISIBLE_DEVICES, *contract.TORCHRUN_ENV}
    assert always <= contract.RESERVED_ENV
    assert set(contract.torchrun_env(1, 4, 29500)) == set(contract.TORCHRUN_ENV)


def test_one_exit_code_and_one_default_grace():
    from tidal.exec import protocol
    from tidal.train import env, session

    assert env.EXIT_PREEMPTED == protocol.EXIT_PREEMPTED == contract.EXIT_PREEMPTED == 75
    assert session.Preempted(3, []).code == contract.EXIT_PREEMPTED
    grace = contract.DEFAULT_GRACE_S
    spec = JobSpec(name="x", gpus=1, command=["true"])
    assert env.Env().grace_s == spec.grace_s == grace
    assert SchedulerConfig().preempt_grace_s == LoanTiming().notice_s == grace


def test_the_simulated_scenario_keeps_its_own_notice():
    from tidal.sim.config import SIM_NOTICE_S, SimConfig, make_config

    for cfg in (SimConfig(serving_gpus=8), make_config(serving_gpus=8)):
        assert cfg.timing.notice_s == cfg.scheduler.preempt_grace_s == SIM_NOTICE_S
        assert SIM_NOTICE_S != contract.DEFAULT_GRACE_S


def test_the_contract_and_the_control_plane_import_no_torch():
    src = Path(contract.__file__).read_text()
    assert "from tidal" not in src and "import tidal" not in src
    code = ("import sys, tidal.contract, tidal.control.controller, tidal.exec.local, tidal.policy.scheduler; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
