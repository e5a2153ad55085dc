"""What the runtime, the executors and the control plane agree on, each fact once: environment variables
(docs/train.md has the table), exit codes, the files a job and its executor talk through, the default
grace. Imports nothing of ours, no torch: every side may import it."""

from __future__ import annotations

import os
import sys

# ------------------------------------------------------------------------------ torchrun contract
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"

# ------------------------------------------------------------------------------ Tidal's variables
# Set by the platform for every rank (the executor or the control plane), read by the runtime.
ENV_JOB_ID = "TIDAL_JOB_ID"
ENV_PROGRESS_DIR = "TIDAL_PROGRESS_DIR"
ENV_CONTROL_FILE = "TIDAL_CONTROL_FILE"
ENV_GRACE_S = "TIDAL_GRACE_S"
ENV_CKPT_URL = "TIDAL_CKPT_URL"
ENV_CKPT_TIERS = "TIDAL_CKPT_TIERS"
ENV_CKPT_INTERVAL_S = "TIDAL_CKPT_INTERVAL_S"
ENV_ATTEMPT = "TIDAL_ATTEMPT"  # the attempt of the job these ranks belong to (1, 2, ...): its fence claim
# Read by the runtime; set by a launcher or the user.
ENV_CKPT_INTERVAL_STEPS = "TIDAL_CKPT_INTERVAL_STEPS"
ENV_CKPT_KEEP = "TIDAL_CKPT_KEEP"
ENV_NOTICE_FILE = "TIDAL_NOTICE_FILE"
ENV_NOTICE_WAIT = "TIDAL_NOTICE_WAIT"
ENV_SHM_DIR = "TIDAL_SHM_DIR"  # the checkpoint engine's node-memory tier (and the agents')
ENV_CKPT_AGENT = "TIDAL_CKPT_AGENT"  # this node's checkpoint agent, host:port
ENV_CKPT_PEERS = "TIDAL_CKPT_PEERS"  # more agents to read from, comma-separated
ENV_CKPT_AGENT_TOKEN = "TIDAL_CKPT_AGENT_TOKEN"  # this job's credential at the agents (its namespace's)
ENV_CKPT_AGENT_KEY = "TIDAL_CKPT_AGENT_KEY"  # an agent's own: the key it checks tokens with (hex)
ENV_CKPT_KEY = "TIDAL_CKPT_KEY"  # this job's: the key its manifests are signed and checked with (hex)
# The control plane's address and credentials (the CLI's; reserved for the runtime).
ENV_API_URL = "TIDAL_API_URL"
ENV_TOKEN = "TIDAL_TOKEN"
ENV_STATE_DIR = "TIDAL_STATE_DIR"  # where `tidal up` keeps its database, jobs and tokens

TORCHRUN_ENV = (ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE, ENV_GROUP_RANK,
                ENV_MASTER_ADDR, ENV_MASTER_PORT)
RESERVED_ENV = frozenset({
    *TORCHRUN_ENV, ENV_CUDA_VISIBLE_DEVICES, ENV_JOB_ID, ENV_CKPT_URL, ENV_CKPT_INTERVAL_S, ENV_PROGRESS_DIR,
    ENV_CONTROL_FILE, ENV_GRACE_S, ENV_API_URL, ENV_TOKEN, ENV_ATTEMPT,
    ENV_CKPT_TIERS,  # a spec names its tiers in checkpoint.tiers, where the location rules check them
    ENV_CKPT_AGENT_TOKEN, ENV_CKPT_AGENT_KEY, ENV_CKPT_KEY,
})
"""Set by the platform for every rank; a job's spec may not set them."""


def torchrun_env(rank: int, world_size: int, master_port: int, *, master_addr: str = "127.0.0.1",
                 local_rank: int | None = None, local_world_size: int | None = None,
                 group_rank: int = 0) -> dict[str, str]:
    """The torchrun variables of rank ``rank`` of ``world_size``; one node unless told otherwise
    (``local_rank`` = ``rank``, ``local_world_size`` = ``world_size``, ``group_rank`` 0)."""
    return {ENV_RANK: str(rank), ENV_WORLD_SIZE: str(world_size),
            ENV_LOCAL_RANK: str(rank if local_rank is None else local_rank),
            ENV_LOCAL_WORLD_SIZE: str(world_size if local_world_size is None else local_world_size),
            ENV_GROUP_RANK: str(group_rank), ENV_MASTER_ADDR: master_addr, ENV_MASTER_PORT: str(master_port)}


def one_node_env() -> dict[str, str]:
    """What ranks that all run on this machine add to :func:`torchrun_env`: gloo over the loopback
    interface where Linux has one (never depend on how the hostname resolves)."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        return {ENV_GLOO_SOCKET_IFNAME: "lo"}
    return {}


# ------------------------------------------------------------------------------ exit codes
EXIT_PREEMPTED = 75
"""EX_TEMPFAIL from sysexits.h ("temporary failure, try again"): the job stopped on a notice (or its
grace ran out) and resumes from its newest committed checkpoint. Never a failure."""
EXIT_FENCED = 77
"""EX_NOPERM from sysexits.h: a stale attempt's rank whose commit the fence of its checkpoint location
refused (another job or a newer attempt of this one owns it now, :data:`FENCE_FILE`); it stops."""
RAY_NODE_LABEL = "tidal.io/node"  # a Ray node's name for Tidal (ray start --labels tidal.io/node=NAME)
# Ray's token authentication (Ray >= 2.52; docs/control.md, Isolation on Ray): the mode ("token") and the
# token, given in the environment or as a file (0600) that only Ray's own user reads. Never a job's.
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"

PHASE_ENDED = "ended"
"""The heartbeat's phase once the runtime closed cleanly: the rank finished, whatever its exit code
(docs/train.md, Exit codes)."""

# ------------------------------------------------------------------------------ grace
DEFAULT_GRACE_S = 30.0
"""Seconds from a stop notice (SIGTERM, the notice file, a reclaim) to the forced exit."""


# ------------------------------------------------------------------------------ files
def progress_file(rank: int) -> str:
    """The runtime's JSON-lines progress records of ``rank`` (in ``TIDAL_PROGRESS_DIR``)."""
    return f"progress-r{rank:05d}.jsonl"


def heartbeat_file(rank: int) -> str:
    """The runtime's heartbeat of ``rank`` (in ``TIDAL_PROGRESS_DIR``), replaced atomically."""
    return f"heartbeat-r{rank:05d}.json"


def attempt_dirname(attempt: int | str) -> str:
    """An executor's directory of one attempt of a job (under the job's directory); ``"*"``: a glob."""
    return f"attempt-{attempt}"


PROGRESS_DIRNAME = "progress"  # in an attempt's directory: what TIDAL_PROGRESS_DIR names
LAUNCH_FILE = "launch.json"  # in an attempt's directory: the ranks' pids, written before any starts
CONTROL_FILE = "control.json"  # in an attempt's directory: what TIDAL_CONTROL_FILE names
FENCE_FILE = "fence.json"  # in a job's checkpoint directory: which job and attempt own it (tidal.ckpt.fence)


def exit_file(rank: int) -> str:
    """In an attempt's directory: ``rank``'s exit code, written by its shim."""
    return f"exit-{rank}.json"


def pid_file(rank: int) -> str:
    """In an attempt's directory: ``rank``'s own pid (under its shim)."""
    return f"pid-{rank}.json"
