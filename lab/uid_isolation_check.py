"""A torch job under ``isolation.uid_base``: a 2-rank (``--gpus``) DDP run of the GPT example (gloo)
started by a real ``tidal up`` as root, each rank as the tenant's own uid; on the local executor, or
(``--ray``) on a local 3-node Ray cluster (tests/ray_cluster.py, workers as root) with ``--executor
ray``. Not in ``make test``: it needs a Python that other uids can execute (this project's usual
interpreter lives under /root, 0700). Made once with

    /usr/bin/python3 -m venv /opt/tidal-uidcheck
    /opt/tidal-uidcheck/bin/pip install torch==2.13.0 && /opt/tidal-uidcheck/bin/pip install -e .
    OMP_NUM_THREADS=1 /opt/tidal-uidcheck/bin/python lab/uid_isolation_check.py
    # on Ray: the plane and the rank actors need ray (this project's venv), only the ranks run /opt's Python
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python lab/uid_isolation_check.py --ray \\
        --job-python /opt/tidal-uidcheck/bin/python

The ranks import this tree's ``tidal`` (``PYTHONPATH=<repo>/src`` in the job's ``env``). It prints the
job's end, where its ranks ran, rank 0's log and who owns the job's progress and checkpoints.
``--resume``: with ``per: job``, then a second job (its own uid) ``resume_from`` the first: the step
it starts at, who owns the location after it (the hand-over, tidal.exec.handover).
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from plane_proc import Plane, wait_until  # noqa: E402
from tidal.control.client import TidalClient  # noqa: E402

CONFIG = (
    "restart_backoff_s: 0.2\nloop_interval_s: 0.2\nisolation:\n  uid_base: 200000\n  shm_dir: {base}/shm\n"
)
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block", "16", "--micro-batch", "2",
        "--log-every", "5"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ray", action="store_true", help="on a local 3-node Ray cluster (--executor ray)")
    ap.add_argument("--gpus", type=int, default=2, help="ranks (on Ray 3 spans nodes: n1 has 2 GPUs)")
    ap.add_argument("--resume", action="store_true", help="per: job, then a second job resumes the first")
    ap.add_argument("--job-python", default=sys.executable, help="the ranks' interpreter (other uids must "
                    "be able to run it)")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="uidcheck-", dir="/tmp"))
    base.chmod(0o711)  # other uids pass through to their own directories
    rc = None
    if a.ray:
        import ray_cluster

        rc = ray_cluster.start()
        p = Plane(base, CONFIG.format(base=base) + ("  per: job\n" if a.resume else ""), gpus=None,
                  args=("--executor", "ray", "--ray-address", rc.address))
        rc.state_roots.append(p.state / "jobs")
    else:
        p = Plane(base, CONFIG.format(base=base) + ("  per: job\n" if a.resume else ""), gpus=a.gpus)
    try:
        p.start()
        c = TidalClient(p.url, p.admin.create_tenant("alice", quota_gpus=a.gpus)["token"])

        def run(steps: int, **more) -> str:
            jid = c.submit(
                {
                    "name": "gpt",
                    "gpus": a.gpus,
                    "max_restarts": 0,
                    "workdir": str(REPO),
                    "env": {"PYTHONPATH": str(REPO / "src")},
                    "command": [a.job_python, "examples/gpt/train.py", "--parallel", "ddp", "--steps",
                                str(steps), "--ckpt-every", "10", "--global-batch", str(2 * a.gpus), *TINY],
                    **more,
                }
            )["id"]
            wait_until("job ends", lambda: c.job(jid)["state"] in ("succeeded", "failed", "cancelled"), 300)
            return jid

        jid = run(20)
        job = c.job(jid)
        print("state", job["state"], job.get("message"))
        d = p.state / "jobs" / jid
        launch = json.loads((d / "attempt-1" / "launch.json").read_text())
        ranks = [(r["rank"], r.get("node", "local")) for r in launch["ranks"]]
        print("owner", launch.get("owner"), "ranks", ranks)
        print(c.logs(jid, rank=0)["data"][-600:])
        progress = d / "attempt-1" / "progress"
        print("progress owner", progress.stat().st_uid, oct(progress.stat().st_mode & 0o777))
        ck = d / "ckpt"
        print("ckpt steps", sorted(x.name for x in ck.iterdir()), "owner", ck.stat().st_uid)
        if a.resume:
            second = run(30, checkpoint={"resume_from": jid})
            job2 = c.job(second)
            log = c.logs(second, rank=0)["data"]
            launch2 = p.state / "jobs" / second / "attempt-1" / "launch.json"
            owner2 = json.loads(launch2.read_text())["owner"]
            print("second job", job2["state"], job2.get("message"), "owner", owner2)
            print("\n".join(x for x in log.splitlines() if "starting at step" in x or "step    30" in x))
            print("ckpt steps", sorted(x.name for x in ck.iterdir()),
                  "owners", sorted({x.stat().st_uid for x in (ck, *ck.rglob("*"))}))
        left = [str(x.relative_to(base)) for x in (base / "shm").glob("**/*") if x.is_dir()]
        print("shm dirs left", sorted(left))
    finally:
        p.stop()
        if rc is not None:
            import ray_cluster

            ray_cluster.stop(rc)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
