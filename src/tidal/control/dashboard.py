"""The web dashboard, served by ``tidal up`` itself: a static page and the read-only JSON it polls.

The page (``GET /dashboard``) carries no data and needs no token: it asks for a bearer token once, keeps it in
``sessionStorage`` (never in a URL, cookie or log) and calls the API with it, so it sees what that token sees.
It renders with ``textContent`` only, under a Content-Security-Policy allowing scripts from this server alone.
Its JSON routes (``/v1/dashboard/pool``, ``jobs``, ``jobs/{id}/curves``, ``serving``) are in docs/control.md;
each refresh costs a page of rows or the active jobs, never every job.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations, some local (``Caller``).
import mimetypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.responses import RedirectResponse

from tidal.control import dashboard_views as dv
from tidal.control import schemas as sc
from tidal.control.accounting import job_report
from tidal.control.auth import visible_job
from tidal.control.context import ApiContext
from tidal.control.read_view import QUEUE_SHOWN
from tidal.control.render import Raw, SafeJSON, json_bytes, json_object, json_route
from tidal.control.states import ACTIVE, State
from tidal.control.store import HeldJob, TenantRow
from tidal.model import Node

WEB_DIR = Path(__file__).parent / "web"
DASHBOARD_PATH = "/dashboard"
PAGE_SIZE_MAX = 200
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def dashboard_url(api_url: str) -> str:
    """The dashboard's address on a ``tidal up`` listening at ``api_url``."""
    return api_url.rstrip("/") + DASHBOARD_PATH


def _assets() -> dict[str, tuple[bytes, str]]:
    """Every file under ``web/`` by its path there, read once: a request names one of these or gets 404
    (no path from a request ever reaches the filesystem)."""
    out = {}
    for p in sorted(WEB_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".html", ".js", ".css", ".svg"):
            kind = mimetypes.guess_type(p.name)[0] or "application/octet-stream"
            if kind.startswith("text/") or kind.endswith("javascript"):
                kind += "; charset=utf-8"
            out[p.relative_to(WEB_DIR).as_posix()] = (p.read_bytes(), kind)
    return out


_PROGRESS = ("step", "loss", "steps_per_s")


def compact_job(j: Any, now_s: float) -> sc.JobSummary:
    """A row of the jobs table: the model's fields read from the row, the progress ones from its
    progress, and its ETTR."""
    p = j.progress or {}
    return sc.JobSummary.model_validate({
        **{f: getattr(j, f) for f in sc.JobSummary.model_fields if f not in (*_PROGRESS, "ettr")},
        **{f: p.get(f) for f in _PROGRESS}, "ettr": job_report(j, now_s)["ettr"]})


def _gpu_map(nodes: Sequence[Node], held: Sequence[HeldJob], viewer: str | None, loans: dict[str, Any] | None,
             *, rendered: bool = False) -> tuple[Any, dict[str, int]]:
    """(the GPU map of ``viewer``, :func:`~tidal.control.dashboard_views.gpu_map`, rendered as JSON with
    ``rendered``; the GPUs per kind of segment)."""
    nodes_map = dv.gpu_map(nodes, held, viewer, loans)
    kinds = ("job", "draining", "lent", "warming", "serving", "free")
    totals = dict.fromkeys(kinds, 0)
    for n in nodes_map:
        for seg in n["segments"]:
            totals[seg["kind"]] += seg["gpus"]
    return (Raw(json_bytes(nodes_map)) if rendered else nodes_map), totals


def dashboard_router(ctx: ApiContext, caller: Callable[..., Any]) -> APIRouter:
    """The dashboard's routes; ``caller`` is the API's bearer-token dependency (a :class:`TenantRow`)."""
    store = ctx.store
    assets = _assets()
    router = APIRouter()
    Caller = Annotated[TenantRow, Depends(caller)]
    kept: list[tuple[int, list[TenantRow]]] = [(-1, [])]

    def all_tenants() -> list[TenantRow]:
        """The tenants, read again only when one was added (``Store.tenant_rev``)."""
        rev, rows = kept[0]
        if rev != store.tenant_rev:
            rev = store.tenant_rev  # (before the read: a tenant added meanwhile reads them again next time)
            rows = store.tenants()
            kept[0] = (rev, rows)
        return rows

    @router.get("/", include_in_schema=False)
    def root() -> Response:
        return RedirectResponse(DASHBOARD_PATH, status_code=307)

    @router.get(DASHBOARD_PATH, include_in_schema=False)
    def page() -> Response:
        body, kind = assets["index.html"]
        return Response(body, media_type=kind, headers=SECURITY_HEADERS)

    @router.get(DASHBOARD_PATH + "/assets/{name:path}", include_in_schema=False)
    def asset(name: str) -> Response:
        found = assets.get(name)
        if found is None or name == "index.html":
            raise HTTPException(404, f"no dashboard asset {name!r}")
        return Response(found[0], media_type=found[1], headers=SECURITY_HEADERS)

    @router.get("/v1/dashboard/pool")
    @json_route()
    def pool(me: Caller) -> Any:
        """GPUs per node by holder, per tenant usage against quota and fair share, and the queue: as the
        reconcile loop's newest step left them (``as_of_s``, ``step``; the jobs submitted since counted,
        :mod:`tidal.control.read_view`), else read from the store now (``step`` null)."""
        viewer = None if me.admin else me.name
        now = ctx.clock()
        view = ctx.view() if ctx.view is not None else None
        nodes: list[Node] | tuple[Node, ...]
        if view is None:
            held: Sequence[HeldJob] = store.held()  # (the waiting ones: counted, the queue's head read)
            waiting = store.count_waiting()
            loans = ctx.loans.view() if ctx.loans is not None else None
            nodes, states = ctx.nodes, store.count_by_state(viewer)
            gpus, totals = _gpu_map(nodes, held, viewer, loans)
            head: Sequence[Any] = store.waiting_head(QUEUE_SHOWN)
        else:
            held, waiting, loans = view.held, view.waiting_counts(store.submitted), view.loans
            nodes, states = view.nodes, view.by_state(store.submitted, viewer)
            gpus, totals = view.memo(("gpu_map", viewer),
                                     lambda v: _gpu_map(v.nodes, v.held, viewer, v.loans, rendered=True))
            head = view.head
        lent = (loans or {}).get("lent_gpus", 0)
        tenants = all_tenants()

        def usage_of(rows: list[TenantRow]) -> Callable[[Any], list[dict[str, Any]]]:
            return lambda _: dv.tenant_usage(rows, held, waiting, nodes, lent)

        if view is None:
            usage = usage_of(tenants if me.admin else [me])(None)
            everyone = usage if me.admin else usage_of(tenants)(None)
        else:  # (the same for every reader of the view until a job is submitted or a tenant added)
            key = ("usage", tuple(sorted(view.since(store.submitted).items())), store.tenant_rev, lent)
            everyone = view.memo((*key, None), usage_of(tenants), warm=False)
            usage = everyone if me.admin else view.memo((*key, me.name), usage_of([me]), warm=False)
        if not me.admin:
            usage = [u for u in usage if u["tenant"] == me.name]
        # the queue: every tenant's waiting jobs count for positions; others' show no id
        queue = dv.queue_view(head, sum(waiting.values()), everyone, totals["free"], totals["lent"], now,
                              viewer)
        return json_object({
            "now_s": now, "as_of_s": view.as_of_s if view is not None else now,
            "step": view.step if view is not None else None, "tenant": me.name, "admin": me.admin,
            "nodes": gpus, "totals": totals, "gpus": sum(n.gpus for n in nodes), "tenants": usage,
            "queue": queue, "states": {s: n for s, n in states.items() if s in ACTIVE},
            "serving": ctx.loans is not None or ctx.serving is not None, "warning": ctx.warning})

    @router.get("/v1/dashboard/jobs")
    @json_route()
    def jobs(me: Caller, state: Annotated[list[State] | None, Query()] = None, kind: str | None = None,
             tenant: str | None = None, q: Annotated[str | None, Query(max_length=80)] = None,
             offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
             limit: Annotated[int, Query(ge=1, le=PAGE_SIZE_MAX)] = 50) -> dict:
        """One page of jobs (newest first), filtered; ``total`` counts every match."""
        if kind is not None and kind not in ("spot", "dedicated"):
            raise HTTPException(422, f"kind: must be spot or dedicated, got {kind[:40]!r}")
        for field, value in (("q", q), ("tenant", tenant)):
            if value is not None and any(ord(ch) < 32 for ch in value):
                raise HTTPException(422, f"{field}: must not hold a control character (NUL, newline, ...)")
        who = (tenant or None) if me.admin else me.name
        rows, total = store.jobs_page(tenant=who, states=state, kind=kind, match=q, limit=limit,
                                      offset=offset)
        now = ctx.clock()
        page = sc.JobPage(total=total, offset=offset, limit=limit, jobs=[compact_job(j, now) for j in rows])
        return sc.answer(page)

    @router.get("/v1/dashboard/jobs/{job_id}/curves")
    @json_route()
    def job_curves(job_id: str, me: Caller) -> dict:
        """Loss and throughput per attempt (rank 0's progress records), restores and checkpoints."""
        j = visible_job(store, job_id, me)
        if j is None:
            raise HTTPException(404, f"job {job_id} not found")
        if ctx.job_dir is None:
            return {"job": j.id, "attempts": [], "first_attempt": 1}
        return {"job": j.id, **dv.curves(Path(ctx.job_dir(j.id)), j.attempt)}

    @router.get("/v1/dashboard/serving")
    @json_route()
    def serving(_: Caller, after: Annotated[float, Query(allow_inf_nan=False)] = 0.0) -> Any:
        """The loan timeline (steps after ``after``, control-plane seconds) and the plan now; jobs on
        lent GPUs are named by the pool page only (tenants see no other tenant's job here)."""
        if ctx.loans is not None:
            hist = ctx.loans.history
            return {"configured": True, "lending": True, "view": ctx.loans.view(),
                    "history": [h for h in hist if h["t"] > after] if after else list(hist)}
        if ctx.serving is not None and ctx.serving[0] is not None:
            latest = ctx.serving[0].latest
            return {"configured": True, "lending": False, "view": latest.as_dict() if latest else None,
                    "history": []}
        return SafeJSON({"configured": False, "lending": False, "view": None, "history": []})

    return router
