"""A torch job under ``isolation.uid_base``: a 2-rank DDP run of the GPT example (gloo) started by a real
``tidal up`` as root, each rank as the tenant's own uid. Not in ``make test``: it needs a Python that
other uids can execute (this project's usual interpreter lives under /root, 0700). Made once with

    /usr/bin/python3 -m venv /opt/tidal-uidcheck
    /opt/tidal-uidcheck/bin/pip install torch==2.13.0 && /opt/tidal-uidcheck/bin/pip install -e .
    OMP_NUM_THREADS=1 /opt/tidal-uidcheck/bin/python benchmarks/uid_isolation_check.py

It prints the job's end, rank 0's log and who owns the job's progress and checkpoints.
"""
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
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block", "16", "--global-batch", "4",
        "--micro-batch", "2", "--log-every", "5"]


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="uidcheck-", dir="/tmp"))
    base.chmod(0o711)  # other uids pass through to their own directories
    p = Plane(base, CONFIG.format(base=base), gpus=2)
    p.start()
    try:
        c = TidalClient(p.url, p.admin.create_tenant("alice", quota_gpus=2)["token"])
        jid = c.submit(
            {
                "name": "gpt",
                "gpus": 2,
                "max_restarts": 0,
                "workdir": str(REPO),
                "command": [
                    sys.executable,
                    "examples/gpt/train.py",
                    "--parallel",
                    "ddp",
                    "--steps",
                    "20",
                    "--ckpt-every",
                    "10",
                    *TINY,
                ],
            }
        )["id"]
        wait_until("job ends", lambda: c.job(jid)["state"] in ("succeeded", "failed", "cancelled"), 300)
        job = c.job(jid)
        print("state", job["state"], job.get("message"))
        print(c.logs(jid, rank=0)["data"][-600:])
        d = p.state / "jobs" / jid
        progress = d / "attempt-1" / "progress"
        print("progress owner", progress.stat().st_uid, oct(progress.stat().st_mode & 0o777))
        ck = d / "ckpt"
        print("ckpt steps", sorted(x.name for x in ck.iterdir()), "owner", ck.stat().st_uid)
        print("shm dirs left", sorted(x.name for x in (base / "shm").iterdir()))
    finally:
        p.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
