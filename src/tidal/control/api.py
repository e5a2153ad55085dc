"""The REST API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``; the routes in docs/control.md).

Every ``/v1`` call carries ``Authorization: Bearer <token>``. A tenant sees and acts on its own jobs, logs,
checkpoints and events only (another tenant's job is "not found", so ids do not leak); the admin sees
everything and manages tenants. ``/healthz`` is open; ``/metrics`` takes the admin's token.

Hostile input: a body over ``MAX_BODY_BYTES`` is a 413 while it is read; a body not UTF-8 JSON is a 400; a
refused spec field is a 422 naming it (:mod:`tidal.control.spec`); a failing store answers 500 and stores
nothing, a deleted one 503. No stored value can make a response fail (a lone surrogate is escaped, a NaN
becomes null). The API only writes requests into the store; the reconcile loop acts on them.

Handlers that read the store or files are plain ``def`` and return their JSON already rendered
(:func:`~tidal.control.render.json_route`), so a call makes one trip to the thread pool. The bearer token is
checked in the event loop against the store's memory of known tokens; only an unseen token goes to the
database, in the pool.
"""

import codecs
import json
import math
import os
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidal.control import locations as loc_policy
from tidal.control import metrics
from tidal.control import schemas as sc
from tidal.control.auth import authenticate, create_tenant, token_hash, visible_job
from tidal.control.context import ApiContext
from tidal.control.dashboard import dashboard_router
from tidal.control.job_views import default_ckpt
from tidal.control.limits import QuotaMeter
from tidal.control.read_view import PlaneView
from tidal.control.render import Raw, SafeJSON, json_bytes, json_object, json_route
from tidal.control.spec import Int, JobSpec, Num, clean_msg, error_path
from tidal.control.states import TERMINAL, State
from tidal.control.store import NotFound, StoreUnavailable, TenantRow
from tidal.control.views import checkpoint_view, event_view, job_view, pool_view
from tidal.files import open_plain

M = TypeVar("M", bound=BaseModel)
MAX_LOG_CHUNK_BYTES = 1 << 20
TOO_DEEP = "the request body is nested too deeply (a job spec is a few levels of objects and lists)"
MAX_BODY_BYTES = 1 << 20  # a request body (a job spec is a few hundred bytes)
POOL_PAGE, POOL_PAGE_MAX = 512, 4096  # nodes listed by GET /v1/pool: by default, at most
JOBS_PAGE, JOBS_PAGE_MAX = 1000, 10000  # jobs listed by GET /v1/jobs: by default, at most
SQL_INT_MAX = (1 << 31) - 1  # an offset or id the store's queries take (PostgreSQL's INTEGER); over it a 422
# 422 error types no JSON schema can declare: the refusals that depend on the plane's state (its pool, the
# tenant's quotas and limits, other jobs' checkpoint locations), the tier grammar, the relations of the
# GPU sizes and the text rules inside free-form values (a NUL byte or a lone surrogate in a tier option's
# key, nesting too deep); every other 422 of a request is a rule its schema declares (tests/test_fuzz_api.py).
UNDECLARED_RULES = frozenset({"priority_limit", "capacity", "quota", "checkpoint_location",
                              "checkpoint_quota", "tiers", "gpus", "text"})
ERRORS = {400: "the body is not UTF-8 JSON", 401: "missing or unknown bearer token",
          403: "only the admin may do this", 404: "not found (another tenant's job is not found either)",
          409: "conflicts with the current state", 413: "request body too large",
          422: "refused: each field named", 429: "over the tenant's submission limits (Retry-After)",
          503: "the store is unavailable"}


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    quota_gpus: Int = Field(
        default=0, ge=0, le=1 << 20, description="training GPUs guaranteed to dedicated jobs"
    )
    weight: Num = Field(
        default=1.0, gt=0, le=1e6, allow_inf_nan=False, description="share of spot capacity"
    )
    max_priority: Int = Field(
        default=0, ge=-1000, le=1000, description="the highest priority its jobs may ask for"
    )


def _unprocessable(errors: list[dict[str, Any]]) -> JSONResponse:
    return JSONResponse(
        status_code=422,
        content={"detail": errors, "errors": [f"{e['field'] or '(body)'}: {e['msg']}" for e in errors]})


def _refused(errors: Any, *prefix: str) -> JSONResponse:
    """422 for pydantic's ``errors``, located under ``prefix`` (``"body"``: errors of the job spec)."""
    return _unprocessable([{"loc": [*prefix, *e["loc"]], "field": error_path(e["loc"]),
                            "msg": clean_msg(e["msg"]), "type": e["type"]} for e in errors])


def _problem(field: str, kind: str, msg: str) -> dict[str, Any]:
    """A refused field of the submitted spec (``gpus.min``) that validation alone cannot find."""
    return {"loc": ["body", *field.split(".")], "field": field, "type": kind, "msg": msg}


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413 naming the limit: at once when its
    ``Content-Length`` says so, else as soon as the bytes read pass it (nothing more is buffered)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    def _detail(self) -> str:
        return f"request body too large: the limit is {self.limit} bytes ({self.limit >> 10} KiB)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.limit
            except ValueError:
                too_big = False
            if too_big:
                await JSONResponse({"detail": self._detail()}, status_code=413)(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self._detail())
            return msg

        await self.app(scope, limited, send)


def _doc(ok: Any, *errors: int, status: int = 200) -> dict[str, Any]:
    """OpenAPI for a route: its answer's model and errors (tests/test_openapi.py checks the real answers)."""
    out: dict[int | str, dict[str, Any]] = {status: {"model": ok}} if ok is not None else {}
    for code in (*errors, 503):
        model = sc.ValidationProblem if code == 422 else sc.Problem
        out[code] = {"model": model, "description": ERRORS[code]}
    return {"responses": out, "response_model": None}


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(title="Tidal", version="0.1.0", default_response_class=SafeJSON,
                  description="Run training jobs on a shared GPU pool. Bearer auth; see docs/control.md.")
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    store = ctx.store
    policy = ctx.locations or loc_policy.LocationPolicy()
    ckpt_bytes = QuotaMeter(  # (a tenant's jobs are read only for a count)
        lambda tenant: loc_policy.homes(store.jobs(tenant=tenant), ctx.ckpt_root), policy.quota)
    reg = metrics.registry(store, ctx.nodes, ctx.clock, ctx.serving[0] if ctx.serving else None, ctx.loans,
                           view=ctx.view)
    pool_gpus = sum(n.gpus for n in ctx.nodes)

    def _view() -> PlaneView | None:
        """The reconcile loop's newest view (None without a loop, or before its first step)."""
        return ctx.view() if ctx.view is not None else None

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _refused(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:  # Allow: every method of the path (Starlette names only one route's)
            allowed = {m for r in app.router.routes if isinstance(r, Route)
                       and r.matches(request.scope)[0] is not Match.NONE for m in r.methods or ()}
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(sorted(allowed))}
        return await http_exception_handler(request, exc)

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # a body nested thousands of levels deep (``[[[[...``) overflows the JSON parser or a validator
        return JSONResponse({"detail": TOO_DEEP}, status_code=400)

    @app.exception_handler(StoreUnavailable)
    async def _gone(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(SQLAlchemyError)
    async def _storage(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        return JSONResponse({"detail": f"the store failed ({type(exc).__name__}); nothing was changed"},
                            status_code=500)

    async def tenant(authorization: Annotated[str | None, Header()] = None) -> TenantRow:
        token = (
            authorization[7:].strip() if authorization and authorization[:7].lower() == "bearer " else None
        )
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
        job = visible_job(store, job_id, me)
        if job is None:
            raise HTTPException(404, f"job {job_id} not found")
        return job

    @app.get("/healthz", **_doc(sc.Health))
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format 0.0.4",
              "content": {"text/plain": {"schema": {"type": "string"}}}},
        **{k: v for k, v in _doc(None, 401, 403)["responses"].items()}})
    def prometheus(_: Annotated[TenantRow, Depends(admin)]) -> Response:
        return Response(metrics.render(reg), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/whoami", **_doc(sc.WhoAmI, 401))
    @json_route()
    def whoami(me: Caller) -> dict:
        return {"tenant": me.name, "admin": me.admin, "quota_gpus": me.quota_gpus, "weight": me.weight,
                "max_priority": me.max_priority or 0}


    @app.post("/v1/jobs", status_code=201, openapi_extra=_body_doc(JobSpec),
              **_doc(sc.JobDetail, 400, 401, 413, 422, 429, status=201))
    async def submit(request: Request, me: Caller) -> Response:
        """Submit a job spec (JSON); 201 with the job. 413 over the body limit, 400 for a body that is not
        UTF-8 JSON, 422 naming each refused field, 429 over the tenant's submission limits."""
        spec = await _body(request, JobSpec)
        return spec if isinstance(spec, Response) else await run_in_threadpool(_submit, spec, me)

    def _submit(spec: JobSpec, me: TenantRow) -> Response:
        if ctx.limits is None or me.admin:
            return _store_submission(spec, me)
        with ctx.limits.admit(me.name, lambda: _pending(me.name), ctx.clock()) as no:
            if no is not None:
                return SafeJSON({"detail": no[0]}, status_code=429,
                                headers={"Retry-After": str(math.ceil(no[1]))})
            return _store_submission(spec, me)  # (counted toward the tenant's cap until stored)

    def _store_submission(spec: JobSpec, me: TenantRow) -> Response:
        problems = []
        limit = me.max_priority or 0
        if not me.admin and spec.priority > limit:
            problems.append(_problem("priority", "priority_limit", f"priority {spec.priority} is above "
                                     f"tenant {me.name}'s limit of {limit} (max_priority, set by the admin)"))
        if spec.gpus.min > pool_gpus:
            problems.append(_problem("gpus.min", "capacity",
                                     f"{spec.gpus.min} GPUs requested, the pool has {pool_gpus}"))
        if spec.kind == "dedicated" and spec.gpus.min > me.quota_gpus:
            problems.append(_problem("kind", "quota", "a dedicated job runs inside its tenant's quota: it "
                                     f"needs {spec.gpus.min} GPUs, tenant {me.name} has a quota of "
                                     f"{me.quota_gpus} (submit it as spot)"))
        data = spec.model_dump()
        found, ck, loc = loc_policy.check(data["checkpoint"], me.name, me.admin, policy, _located, _source)
        problems += [_problem(f, "checkpoint_location", m) for f, m in found]
        quota = policy.quota(me.name)
        used = 0 if me.admin or quota is None else ckpt_bytes.used(me.name, ctx.clock())
        if not me.admin and quota is not None and used >= quota:
            problems.append(_problem("checkpoint", "checkpoint_quota", f"tenant {me.name}'s checkpoints "
                                     f"hold {used} bytes, its quota is {quota} (checkpoint_quota_bytes; "
                                     f"counted again {loc_policy.QUOTA_RECHECK_S:g} s after): remove old "
                                     "checkpoints or ask the admin"))
        if problems:
            return _unprocessable(problems)
        data["checkpoint"] = ck
        job = store.submit(me.name, data, ctx.clock(), ckpt_location=loc)
        return SafeJSON(job_view(job, ctx.clock(), detail=True), status_code=201)

    def _pending(tenant: str) -> int:
        """The tenant's pending jobs: from the loop's view (no query), else the store's count."""
        if (view := _view()) is not None:
            return view.pending(tenant, store.submitted)
        return store.count_by_state(tenant, [State.PENDING]).get(State.PENDING.value, 0)

    def _located(near: set[str]):
        return [(j, t, loc, State(st) in TERMINAL) for j, t, loc, st in store.ckpt_locations(near)]

    def _source(job_id: str):
        try:
            j = store.job(job_id)
        except NotFound:
            return None
        ck = dict((j.spec or {}).get("checkpoint") or {})
        if not ck.get("url") and not ck.get("tiers"):
            ck["url"] = default_ckpt(ctx.ckpt_root, j)
            if ck["url"] is None:
                return None
        return j.tenant, j.state, ck

    @app.get("/v1/jobs", **_doc(list[sc.Job], 401, 422))
    @json_route()
    def jobs(me: Caller, state: Annotated[list[State] | None, Query()] = None, tenant: str | None = None,
             offset: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
             limit: Annotated[int, Query(ge=1, le=JOBS_PAGE_MAX)] = JOBS_PAGE) -> list[dict]:
        """A page of jobs in submission order (``offset``, ``limit``)."""
        who = tenant if me.admin else me.name
        now = ctx.clock()
        view = _view()
        return [job_view(j, now, view=view)
                for j in store.jobs(tenant=who, states=state, offset=offset, limit=limit)]

    @app.get("/v1/jobs/{job_id}", **_doc(sc.JobDetail, 401, 404))
    @json_route()
    def job(job_id: str, me: Caller) -> dict:
        return job_view(own_job(job_id, me), ctx.clock(), detail=True, view=_view())

    @app.post("/v1/jobs/{job_id}/cancel", **_doc(sc.Job, 401, 404, 409))
    @json_route()
    def cancel(job_id: str, me: Caller) -> dict:
        j = own_job(job_id, me)
        if State(j.state) in TERMINAL:
            raise HTTPException(409, f"job {job_id} already {j.state}")
        if not j.cancel_requested:
            j = store.update(job_id, cancel_requested=True)
            store.record("cancel", f"cancel requested by {me.name}", ctx.clock(), job=j)
        return job_view(j, ctx.clock(), view=_view())

    @app.get("/v1/jobs/{job_id}/logs", **_doc(sc.LogChunk, 401, 404, 422))
    @json_route()
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
        try:  # never through a link a job planted, nor a FIFO, nor a hard link to another's file
            f = open_plain(path, owner=ctx.log_owner) if path is not None else None
        except FileNotFoundError:
            f = None
        except OSError as e:
            raise HTTPException(404, f"job {job_id} rank {rank}: its log is not a regular file of the plane "
                                f"({e.strerror}); not read") from None
        if f is not None:
            with f:
                size = os.fstat(f.fileno()).st_size
                start = offset if offset <= size else 0  # past the end: cut since (max_log_bytes), read anew
                f.seek(start)
                data = f.read(limit)
                text = dec.decode(data, final=done and start + len(data) >= size)
                if dec.getstate()[0]:
                    more = f.read(4 - len(dec.getstate()[0]))
                    data += more
                    text += dec.decode(more, final=done and start + len(data) >= size)
                used = len(data) - len(dec.getstate()[0])
        return {"job": job_id, "rank": rank, "offset": start + used, "size": size, "data": text, "done": done}

    @app.get("/v1/jobs/{job_id}/checkpoints", **_doc(sc.Checkpoints, 401, 404, 409))
    @json_route()
    def checkpoints(job_id: str, me: Caller) -> dict:
        """Committed steps per tier (shm, directory, object storage; read from storage and from the job's
        status file on this node), the newest durable step and its age in seconds."""
        j = own_job(job_id, me)
        ck = (j.spec or {}).get("checkpoint") or {}
        url = ck.get("url") or default_ckpt(ctx.ckpt_root, j)
        if j.ckpt_location and "://" not in j.ckpt_location and loc_policy.moved(j.ckpt_location):
            raise HTTPException(409, f"checkpoint location {j.ckpt_location} now resolves elsewhere (a "
                                "symbolic link replaced a directory on its path): not listed")
        shm = ctx.shm_dir(j.id) if ctx.shm_dir is not None else None  # never the spec's (the tenant's)
        return checkpoint_view(j.id, None if ck.get("tiers") else url, ctx.clock(), tiers=ck.get("tiers"),
                               shm_base=None if shm is None else str(shm))

    @app.get("/v1/events", **_doc(list[sc.Event], 401, 404, 422))
    @json_route()
    def events(me: Caller, job: str | None = None, after: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
               limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> list[dict]:
        if job is not None:
            own_job(job, me)
        rows = store.events(job_id=job, tenant=None if me.admin else me.name, after_id=after, limit=limit)
        return [event_view(e) for e in rows]

    @app.get("/v1/pool", **_doc(sc.Pool, 401))
    @json_route()
    def pool(me: Caller, offset: Annotated[int, Query(ge=0)] = 0,
             limit: Annotated[int, Query(ge=1, le=POOL_PAGE_MAX)] = POOL_PAGE) -> dict | Response:
        """The totals and a page of the nodes (``offset``, ``limit``): as the reconcile loop's newest step
        left them (``as_of_s``), the pending jobs submitted since counted (:mod:`tidal.control.read_view`)."""
        who = None if me.admin else me.name
        view = _view()
        if view is None:
            pending = store.count_by_state(who).get(State.PENDING.value, 0)
            return pool_view(ctx.nodes, store.held(), who, pending, offset=offset, limit=limit,
                             as_of_s=ctx.clock())

        def page(v: PlaneView) -> dict:  # (all but the count of pending jobs, for every reader of a view)
            out = pool_view(v.nodes, v.held, who, 0, offset=offset, limit=limit, as_of_s=v.as_of_s)
            return {**out, "nodes": Raw(json_bytes(out["nodes"]))}

        pending = view.by_state(store.submitted, who).get(State.PENDING.value, 0)
        return json_object({**view.memo(("pool", who, offset, limit), page), "pending": pending})

    @app.get("/v1/serving", **_doc(sc.Serving, 401, 404))
    @json_route()
    def serving(_: Caller) -> dict:
        if ctx.loans is not None:
            describe = ctx.serving[1] if ctx.serving else ""
            return {"source": describe, "lending": True, "advice_only": False, **ctx.loans.view()}
        advisor, describe = ctx.serving or (None, "")
        if advisor is None:
            raise HTTPException(404, "no serving side configured (serving: in tidal up --config; "
                                "docs/control.md)")
        latest = advisor.latest
        return {"source": describe, "serving_gpus": advisor.serving_gpus, "step_s": advisor.step_s,
                "advice_only": True, "latest": latest.as_dict() if latest is not None else None}

    @app.get("/v1/tenants", **_doc(list[sc.Tenant], 401, 403))
    @json_route()
    def tenants(_: Annotated[TenantRow, Depends(admin)]) -> list[dict]:
        return [{"name": t.name, "quota_gpus": t.quota_gpus, "weight": t.weight, "admin": t.admin,
                 "max_priority": t.max_priority or 0} for t in store.tenants()]

    @app.post("/v1/tenants", status_code=201, openapi_extra=_body_doc(TenantSpec),
              **_doc(sc.TenantCreated, 400, 401, 403, 409, 413, 422, status=201))
    async def add_tenant(request: Request, _: Annotated[TenantRow, Depends(admin)]) -> Response:
        body = await _body(request, TenantSpec)
        return body if isinstance(body, Response) else await run_in_threadpool(_add_tenant, body)

    @json_route(201)
    def _add_tenant(body: TenantSpec) -> dict:
        if store.tenant(body.name) is not None:
            raise HTTPException(409, f"tenant {body.name} exists")
        token = create_tenant(store, body.name, quota_gpus=body.quota_gpus, weight=body.weight,
                              now_s=ctx.clock(), max_priority=body.max_priority)
        return {"name": body.name, "quota_gpus": body.quota_gpus, "weight": body.weight,
                "max_priority": body.max_priority, "token": token}

    # The web dashboard (tidal.control.dashboard): its JSON feeds are the page's own, shaped for it and
    # free to change with it, so they are not part of the API's OpenAPI contract.
    app.include_router(dashboard_router(ctx, tenant), include_in_schema=False)

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = base_openapi()
            components = doc.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for model in (JobSpec, TenantSpec):  # the request bodies the handlers parse themselves
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update({model.__name__: body, **body.pop("$defs", {})})
            # The bearer token is checked by a dependency reading the header: declare it as the scheme
            # it is, on every route that answers 401, instead of as an ``authorization`` parameter.
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                         "description": "a tenant's token (TIDAL_TOKEN)"}}
            for ops in doc["paths"].values():
                for op in ops.values():
                    op["parameters"] = [p for p in op.get("parameters", [])
                                        if p["name"].lower() != "authorization"]
                    if not op["parameters"]:
                        del op["parameters"]
                    if "401" in op.get("responses", {}):
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = doc  # (base_openapi cached it already: the same object)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    return app


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI of a JSON request body that the handler parses itself (:func:`_body`)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def _body(request: Request, model: type[M]) -> M | JSONResponse:
    """The request's JSON body validated as ``model``, or the 422 naming each refused field; 400 for a
    body that is not UTF-8, not JSON or nested too deeply (413 past the body limit: :class:`BodyLimit`)."""
    body = bytearray()
    async for chunk in request.stream():  # BodyLimit stops this past MAX_BODY_BYTES
        body += chunk
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        why = f"byte {e.start}: {e.reason}"
        raise HTTPException(400, f"the request body is not valid UTF-8 ({why})") from None
    try:
        return model.model_validate(json.loads(text, parse_constant=_no_constant))
    except RecursionError:
        raise HTTPException(400, TOO_DEEP) from None
    except ValidationError as e:
        return _refused(e.errors(), "body")
    except ValueError as e:
        raise HTTPException(400, f"the request body is not valid JSON: {e}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
