"""The REST API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Every ``/v1`` call carries ``Authorization: Bearer <token>``. A tenant sees and acts on its own
jobs, logs, checkpoints and events only (another tenant's job is "not found", never "forbidden", so ids do not
leak); the admin sees everything and manages tenants. ``/healthz`` and ``/metrics`` are open.

| method and path | what |
|---|---|
| ``POST /v1/jobs`` | submit a job spec (JSON of the YAML); 201 with the job; 422 names the field |
| ``GET /v1/jobs`` | jobs (``?state=running``; admin: ``?tenant=``) |
| ``GET /v1/jobs/{id}`` | one job: state, progress, restarts, lost work, ETTR, spec |
| ``POST /v1/jobs/{id}/cancel`` | cancel (pending: at once; running: notice, then cancelled) |
| ``GET /v1/jobs/{id}/logs?rank=0&offset=0`` | a chunk of a rank's log from ``offset`` (bytes, whole UTF-8 characters); follow by polling with the returned ``offset`` |
| ``GET /v1/jobs/{id}/checkpoints`` | committed checkpoint steps per tier, the newest durable step and its age |
| ``GET /v1/events?job=&after=`` | the event log (every transition, decision and recovery), oldest first |
| ``GET /v1/pool`` | GPUs per node: allocated by tenant, draining, free |
| ``GET /v1/whoami`` | the caller's tenant |
| ``GET, POST /v1/tenants`` | admin: list, create (returns the new tenant's token, once) |

The API writes requests into the store and never touches processes: the reconcile loop acts on
them at its next step.

Handlers that read the store or files are plain ``def`` (FastAPI runs them in its thread pool) and
return their JSON already rendered (``_json``), so a call makes one trip to the pool: FastAPI's
response validation would be a second one, and a synchronous auth dependency a third. The bearer
token is checked in the event loop against the store's memory of known tokens; only a token not
seen yet goes to the database, in the pool.
"""

import codecs
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tidal.contract import ENV_SHM_DIR
from tidal.control import metrics
from tidal.control.auth import authenticate, create_tenant, token_hash
from tidal.control.spec import JobSpec, clean_msg, error_path
from tidal.control.states import HELD, TERMINAL, State
from tidal.control.store import NotFound, Store, TenantRow
from tidal.control.views import checkpoint_view, event_view, job_view, pool_view
from tidal.model import Node

MAX_LOG_CHUNK_BYTES = 1 << 20


@dataclass
class ApiContext:
    """What the API needs: the store, the pool's nodes, where rank logs are, a clock (Unix seconds), and
    where jobs without a ``checkpoint.url`` checkpoint (``<ckpt_root>/<job>/ckpt``, as the controller
    tells their ranks; None: such jobs have no known location)."""

    store: Store
    nodes: list[Node]
    log_path: Callable[[str, int], str | None]
    clock: Callable[[], float]
    ckpt_root: Path | None = None
    serving: tuple[Any, str] | None = None
    """The live loan plan, if configured: (a :class:`tidal.serving.watch.Advisor`, its source described)."""
    loans: Any = None
    """Live lending, if configured: a :class:`tidal.control.loans.LiveLoans` (its ``view()``)."""


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    quota_gpus: int = Field(default=0, ge=0, description="training GPUs guaranteed to dedicated jobs")
    weight: float = Field(default=1.0, gt=0, description="share of spot capacity")


def _unprocessable(errors: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": errors,
                                                  "errors": [f"{e['field'] or '(body)'}: {e['msg']}" for e in errors]})


def _json(status: int = 200) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Render a handler's result as JSON in the handler's own thread (a ``Response`` passes as is)."""

    def wrap(handler: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(handler)
        def run(*args: Any, **kwargs: Any) -> Any:
            out = handler(*args, **kwargs)
            return out if isinstance(out, Response) else JSONResponse(out, status_code=status)

        return run

    return wrap


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(title="Tidal", version="0.1.0",
                  description="Run training jobs on a shared GPU pool. Bearer auth; see docs/control.md.")
    store = ctx.store
    reg = metrics.registry(store, ctx.nodes, ctx.clock, ctx.serving[0] if ctx.serving else None, ctx.loans)
    pool_gpus = sum(n.gpus for n in ctx.nodes)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _unprocessable([{"loc": list(e["loc"]), "field": error_path(e["loc"]), "msg": clean_msg(e["msg"]),
                                "type": e["type"]} for e in exc.errors()])

    async def tenant(authorization: Annotated[str | None, Header()] = None) -> TenantRow:
        token = authorization[7:].strip() if authorization and authorization[:7].lower() == "bearer " else None
        row = store.known_tenant(token_hash(token)) if token else None
        if row is None and token:
            row = await run_in_threadpool(authenticate, store, token)
        if row is None:
            raise HTTPException(401, "missing or unknown bearer token (set TIDAL_TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})
        return row

    Caller = Annotated[TenantRow, Depends(tenant)]

    async def admin(me: Caller) -> TenantRow:
        if not me.admin:
            raise HTTPException(403, "only the admin may do this")
        return me

    def own_job(job_id: str, me: TenantRow):
        try:
            job = store.job(job_id)
        except NotFound:
            job = None
        if job is None or (not me.admin and job.tenant != me.name):
            raise HTTPException(404, f"job {job_id} not found")
        return job

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(reg), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/whoami")
    @_json()
    def whoami(me: Caller) -> dict:
        return {"tenant": me.name, "admin": me.admin, "quota_gpus": me.quota_gpus, "weight": me.weight}

    @app.post("/v1/jobs", status_code=201)
    @_json(201)
    def submit(spec: JobSpec, me: Caller) -> dict:
        problems = []
        if spec.gpus.min > pool_gpus:
            problems.append({"loc": ["body", "gpus", "min"], "field": "gpus.min", "type": "capacity",
                             "msg": f"{spec.gpus.min} GPUs requested, the pool has {pool_gpus}"})
        if spec.kind == "dedicated" and spec.gpus.min > me.quota_gpus:
            problems.append({"loc": ["body", "kind"], "field": "kind", "type": "quota",
                             "msg": f"a dedicated job runs inside its tenant's quota: it needs {spec.gpus.min} "
                                    f"GPUs, tenant {me.name} has a quota of {me.quota_gpus} (submit it as spot)"})
        if problems:
            return _unprocessable(problems)  # type: ignore[return-value]
        job = store.submit(me.name, spec.model_dump(), ctx.clock())
        return job_view(job, ctx.clock(), detail=True)

    @app.get("/v1/jobs")
    @_json()
    def jobs(me: Caller, state: Annotated[list[State] | None, Query()] = None,
             tenant: str | None = None) -> list[dict]:
        who = tenant if me.admin else me.name
        now = ctx.clock()
        return [job_view(j, now) for j in store.jobs(tenant=who, states=state)]

    @app.get("/v1/jobs/{job_id}")
    @_json()
    def job(job_id: str, me: Caller) -> dict:
        return job_view(own_job(job_id, me), ctx.clock(), detail=True)

    @app.post("/v1/jobs/{job_id}/cancel")
    @_json()
    def cancel(job_id: str, me: Caller) -> dict:
        j = own_job(job_id, me)
        if State(j.state) in TERMINAL:
            raise HTTPException(409, f"job {job_id} already {j.state}")
        if not j.cancel_requested:
            j = store.update(job_id, cancel_requested=True)
            store.record("cancel", f"cancel requested by {me.name}", ctx.clock(), job=j)
        return job_view(j, ctx.clock())

    @app.get("/v1/jobs/{job_id}/logs")
    @_json()
    def logs(job_id: str, me: Caller, rank: Annotated[int, Query(ge=0)] = 0,
             offset: Annotated[int, Query(ge=0)] = 0,
             limit: Annotated[int, Query(ge=1, le=MAX_LOG_CHUNK_BYTES)] = 65536) -> dict:
        j = own_job(job_id, me)
        if rank >= max(j.max_gpus, 1):
            raise HTTPException(404, f"job {job_id} has no rank {rank} (ranks 0-{j.max_gpus - 1})")
        path = ctx.log_path(job_id, rank)
        done = State(j.state) in TERMINAL
        # A chunk must not end inside a UTF-8 sequence: ``limit`` may cut one (then up to 3 more bytes
        # complete it), or the rank is still writing it (then it is left for the next call), so the
        # returned ``offset`` always follows whole characters and a follower gets every byte.
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        start = size = used = 0
        text = ""
        if path is not None and os.path.exists(path):
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = min(offset, size)
                f.seek(start)
                data = f.read(limit)
                text = dec.decode(data, final=done and start + len(data) >= size)
                if dec.getstate()[0]:
                    more = f.read(4 - len(dec.getstate()[0]))
                    data += more
                    text += dec.decode(more, final=done and start + len(data) >= size)
                used = len(data) - len(dec.getstate()[0])
        return {"job": job_id, "rank": rank, "offset": start + used, "size": size, "data": text, "done": done}

    @app.get("/v1/jobs/{job_id}/checkpoints")
    @_json()
    def checkpoints(job_id: str, me: Caller) -> dict:
        """Committed steps per tier (shm, directory, object storage; read from storage and from the job's
        status file on this node), the newest durable step and its age in seconds."""
        j = own_job(job_id, me)
        ck = (j.spec or {}).get("checkpoint") or {}
        url = ck.get("url") or (str(ctx.ckpt_root / j.id / "ckpt") if ctx.ckpt_root is not None else None)
        shm_base = ((j.spec or {}).get("env") or {}).get(ENV_SHM_DIR)
        return checkpoint_view(j.id, None if ck.get("tiers") else url, ctx.clock(), tiers=ck.get("tiers"),
                               shm_base=shm_base)

    @app.get("/v1/events")
    @_json()
    def events(me: Caller, job: str | None = None, after: Annotated[int, Query(ge=0)] = 0,
               limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> list[dict]:
        if job is not None:
            own_job(job, me)
        rows = store.events(job_id=job, tenant=None if me.admin else me.name, after_id=after, limit=limit)
        return [event_view(e) for e in rows]

    @app.get("/v1/pool")
    @_json()
    def pool(me: Caller) -> dict:
        return pool_view(ctx.nodes, store.jobs(states=HELD | {State.PENDING}), None if me.admin else me.name)

    @app.get("/v1/serving")
    @_json()
    def serving(_: Caller) -> dict:
        if ctx.loans is not None:
            describe = ctx.serving[1] if ctx.serving else ""
            return {"source": describe, "lending": True, "advice_only": False, **ctx.loans.view()}
        if ctx.serving is None:
            raise HTTPException(404, "no serving side configured (serving: in tidal up --config; docs/control.md)")
        advisor, describe = ctx.serving
        latest = advisor.latest
        return {"source": describe, "serving_gpus": advisor.serving_gpus, "step_s": advisor.step_s,
                "advice_only": True, "latest": latest.as_dict() if latest is not None else None}

    @app.get("/v1/tenants")
    @_json()
    def tenants(_: Annotated[TenantRow, Depends(admin)]) -> list[dict]:
        return [{"name": t.name, "quota_gpus": t.quota_gpus, "weight": t.weight, "admin": t.admin}
                for t in store.tenants()]

    @app.post("/v1/tenants", status_code=201)
    @_json(201)
    def add_tenant(body: TenantSpec, _: Annotated[TenantRow, Depends(admin)]) -> dict:
        if store.tenant(body.name) is not None:
            raise HTTPException(409, f"tenant {body.name} exists")
        token = create_tenant(store, body.name, quota_gpus=body.quota_gpus, weight=body.weight, now_s=ctx.clock())
        return {"name": body.name, "quota_gpus": body.quota_gpus, "weight": body.weight, "token": token}

    return app
