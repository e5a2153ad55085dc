"""What the REST API answers, as pydantic models: the one definition of each answer's shape (the views build
them, so a field a model does not name fails at once; the OpenAPI document uses them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.control.states import State

if TYPE_CHECKING:  # a Literal built from the enum at run time: the type checker sees its values' type
    StateName = str
else:
    StateName = Literal[tuple(s.value for s in State)]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


def answer(model: BaseModel) -> dict[str, Any]:
    """A model as the JSON data the API answers with (fields by their JSON names: ``from``)."""
    return model.model_dump(by_alias=True)


class Problem(_Answer):
    """Every error but a refused request body: one line saying what is wrong."""

    detail: str


class FieldError(_Answer):
    loc: list[str | int]
    field: str = Field(description="the field's path, e.g. gpus.min or command[2]; empty for the whole body")
    msg: str
    type: str


class ValidationProblem(_Answer):
    """422: each refused field, and the same as one line per field (``errors``)."""

    detail: list[FieldError]
    errors: list[str]


class Health(_Answer):
    ok: bool


class WhoAmI(_Answer):
    tenant: str
    admin: bool
    quota_gpus: int
    weight: float
    max_priority: int


class Gpus(_Answer):
    min: int
    max: int
    multiple_of: int


class Report(_Answer):
    restarts: int
    preemptions: int
    lost_work_s: float
    lost_steps: int
    held_s: float
    productive_s: float
    ettr: float | None = Field(description="productive seconds / seconds holding GPUs (null before any)")


class Waiting(_Answer):
    """Why a pending job waits, or a running one below its maximum does not grow (the scheduler's reason)."""

    reason: str
    until_s: float | None = Field(description="when a hold for a time ends (Unix seconds), else null")


class _JobName(_Answer):
    """What names a job in every answer about it: the fields a job answer starts with."""

    id: str
    name: str
    tenant: str
    state: StateName
    kind: Literal["spot", "dedicated"]
    priority: int


class Job(_JobName):
    gpus: Gpus
    placement: dict[str, int] = Field(description="node -> GPUs held")
    attempt: int
    restarts: int
    max_restarts: int
    preemptions: int
    submit_s: float
    started_s: float | None
    finished_s: float | None
    cancel_requested: bool
    message: str
    progress: dict[str, Any] = Field(
        description="step, loss, steps_per_s, checkpoint tiers, heartbeat phase..."
    )
    ckpt_step: int | None
    report: Report
    waiting: Waiting | None


class JobDetail(Job):
    spec: dict[str, Any] = Field(description="the job spec as stored (see JobSpec)")
    handle: dict[str, Any] | None = Field(description="the attempt's ranks (pids) and devices, while it runs")
    retry_at_s: float | None
    ckpt_interval_s: float | None = Field(
        description="the interval the platform set (interval_s: auto), if any"
    )


class JobSummary(_JobName):
    """A row of the dashboard's jobs table: the job's size and progress flattened."""

    gpus: int = Field(description="GPUs held now")
    min_gpus: int
    max_gpus: int
    step: Any = Field(description="progress: the newest step, as the job reported it")
    loss: Any = Field(description="progress: the newest loss, as the job reported it")
    steps_per_s: Any = Field(description="progress: steps per second, as the job reported it")
    ettr: float | None
    restarts: int
    preemptions: int
    attempt: int
    submit_s: float
    message: str


class JobPage(_Answer):
    """One page of the dashboard's jobs table; ``total`` counts every match."""

    total: int
    offset: int
    limit: int
    jobs: list[JobSummary]


class LogChunk(_Answer):
    job: str
    rank: int
    offset: int = Field(description="where the next call should start (bytes; after whole UTF-8 characters)")
    size: int = Field(description="the log's size now, bytes")
    data: str
    done: bool = Field(description="the job has ended: nothing more will be written")


class CheckpointTier(_Answer):
    name: str
    kind: str
    location: str
    durable: bool
    steps: list[int]
    committed_s: dict[str, float]
    source: Literal["storage", "status", "spec"]
    error: str | None


class Checkpoints(_Answer):
    job: str
    url: str | None
    tiers: list[CheckpointTier]
    steps: list[int]
    newest_step: int | None
    newest_durable_step: int | None
    newest_durable_s: float | None
    durable_age_s: float | None
    status_file: str | None
    status_updated_s: float | None
    status_error: str | None = None


class Event(_Answer):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    id: int
    time_s: float
    job: str | None
    tenant: str | None
    kind: str
    from_: str | None = Field(alias="from")
    to: str | None
    message: str
    data: dict[str, Any] | None


class PoolHolder(_Answer):
    job: str | None = Field(description="null for another tenant's job")
    tenant: str
    gpus: int
    draining: int
    state: str


class PoolNode(_Answer):
    name: str
    pool: str
    gpus: int
    allocated: int
    draining: int
    free: int
    jobs: list[PoolHolder]


class Pool(_Answer):
    nodes: list[PoolNode]  # a page: from ``offset``, of ``nodes_total``
    gpus: int
    allocated: int
    free: int
    pending: int
    nodes_total: int = 0
    offset: int = 0
    as_of_s: float | None = Field(default=None, description=(
        "when the GPUs were read (Unix seconds): the reconcile step whose state tidal up serves, or the "
        "store's now; pending counts every job submitted so far"))


class Tenant(_Answer):
    name: str
    quota_gpus: int
    weight: float
    admin: bool
    max_priority: int


class TenantCreated(_Answer):
    name: str
    quota_gpus: int
    weight: float
    max_priority: int
    token: str = Field(description="the tenant's bearer token: shown once, only its hash is stored")


class EngineFigures(_Answer):
    """A real engine's replicas as the serving side reads them (``adapter: llama.cpp``; docs/loaning.md):
    over the last ``window_s``, TTFT at the router, requests running and waiting now, replicas routed and
    warming, and the replicas the latency target needs."""

    engine: str
    url: str = Field(description="the router: send the engine's requests here")
    replicas: int
    routed: int
    warming: int
    running: float
    waiting: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    replicas_needed: float | None
    rate_per_s: float | None
    service_s: float | None
    tokens_per_s: float | None
    warmup_s: float | None = Field(description="p95 of the replicas' recent start-to-healthy times")
    window_s: float
    requests: int
    requests_failed: int

    @classmethod
    def of(cls, health: dict[str, Any]) -> EngineFigures | None:
        """From a serving adapter's ``health()``; None when it runs no engine (or none started yet)."""
        e = health.get("engine") or {}
        if "url" not in e:
            return None
        keep = set(cls.model_fields) - {"engine", "routed"}
        return cls(engine=health["kind"], routed=sum(e["routed"].values()), **{k: e[k] for k in keep})


class Serving(BaseModel):
    """The live loan plan (advice only), or live lending's state; see docs/control.md."""

    model_config = ConfigDict(extra="allow")
    source: str
    advice_only: bool
    engine: EngineFigures | None = None
