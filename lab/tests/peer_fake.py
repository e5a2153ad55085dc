"""A peer adapter for the tests of the peer protocol (our own seam): real files, no peer package.

Run as ``python tests/peer_fake.py <protocol args>``; ``FAKE_PEER_MODE`` picks what it does:

* ``ok`` (default): three engines through :func:`lab.peers.protocol.main`: ``fake_save``
  (``torch.save`` + fsync, loaded back with ``torch.load``), ``fake_cuda`` (cannot be opened: "needs
  CUDA"), ``fake_wrong`` (saves, but its load returns other values, so the warm-up check refuses it),
  ``fake_flaky`` (fails in the second timed save round);
* ``crash``: prints a line to stderr and exits 3;   ``garbage``: writes a document that is not JSON;
* ``hang``: sleeps (the runner's timeout ends it), after starting a child process that sleeps too
  (which the runner must end as well: its pid goes to ``FAKE_PEER_CHILD_PID``).

With ``FAKE_PEER_MODULES`` set, the ``ok`` mode writes there which of Tidal's other dependencies got
imported (none may: a peer's venv has torch and the peer only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _cheap_modes(mode: str, argv: list[str]) -> None:
    """The modes that never get to the protocol (no torch import: they stay quick)."""
    if mode == "crash":
        print("fake peer: ImportError: no module named 'fakepeer'", file=sys.stderr)
        raise SystemExit(3)
    if mode == "garbage":
        with open(argv[argv.index("--out") + 1], "w") as f:
            f.write("{not json")
        raise SystemExit(0)
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_PEER_CHILD_PID"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)


if __name__ == "__main__":
    _cheap_modes(os.environ.get("FAKE_PEER_MODE", "ok"), sys.argv[1:])

import torch  # noqa: E402

from lab.peers.protocol import Context, Engine, copy_into, fsync_tree, main  # noqa: E402


class FakeSave(Engine):
    notes = ("torch.save + fsync",)

    def __init__(self, ctx: Context, wrong: bool = False) -> None:
        self.ctx, self.wrong = ctx, wrong
        self.path = ctx.root / ("wrong.pt" if wrong else "fake.pt")

    def save(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        torch.save(self.ctx.state, self.path)
        t1 = time.perf_counter()
        fsync_tree(self.path)
        return {"stall_s": t1 - t0, "durable_s": time.perf_counter() - t0}

    def loads(self):
        return {"disk": self._load}

    def _load(self, target: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        loaded = torch.load(self.path, weights_only=False)
        if self.wrong:
            loaded["model"] = {k: v + 1 for k, v in loaded["model"].items()}
        copy_into(target, loaded)
        return {"load_disk_s": time.perf_counter() - t0}


class Flaky(FakeSave):
    """Saves in the warm-up, then fails in the second timed round (and its close fails too)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.path = ctx.root / "flaky.pt"
        self.saves = 0

    def save(self, step: int) -> dict[str, float]:
        self.saves += 1
        if self.saves == 3:
            raise OSError("disk full")
        return super().save(step)

    def close(self) -> None:
        raise RuntimeError("already broken")


def open_engines(ctx: Context) -> dict[str, Engine | BaseException]:
    return {"fake_save": FakeSave(ctx), "fake_cuda": RuntimeError("needs CUDA\nsecond line"),
            "fake_wrong": FakeSave(ctx, wrong=True), "fake_flaky": Flaky(ctx)}


TIDAL_ONLY_DEPS = ["safetensors", "typer", "rich", "obstore", "matplotlib", "fastapi", "uvicorn", "pydantic",
                   "sqlalchemy", "httpx", "prometheus_client", "yaml"]

if __name__ == "__main__":
    rc = main("fake", ["torch"], open_engines, sys.argv[1:])
    if os.environ.get("FAKE_PEER_MODULES"):
        with open(os.environ["FAKE_PEER_MODULES"], "w") as f:
            f.write(" ".join(m for m in TIDAL_ONLY_DEPS if m in sys.modules))
    raise SystemExit(rc)
