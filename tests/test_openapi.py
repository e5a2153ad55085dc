"""The OpenAPI document is the API's contract: a valid OpenAPI 3.1 document (openapi-spec-validator)
with bearer auth declared, and every route's real answers from a real ``tidal up`` (successes and the
401/403/404/409/413/422 it gives) declared in it and matching their schemas."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate

from plane_proc import Plane, wait_until

pytestmark = pytest.mark.slow
CONFIG = "loop_interval_s: 0.2\nstartup_timeout_s: 600\n"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(tmp_path_factory.mktemp("openapi"), CONFIG)
    try:
        p.start()
        yield p
    finally:
        p.stop()


class Checked:
    """An HTTP client that checks each answer against the document: its status is declared for the
    operation, and its JSON body matches that status's schema."""

    def __init__(self, url: str, doc: dict[str, Any]) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        self.doc = doc
        self.seen: set[tuple[str, str, str]] = set()

    def __call__(
        self,
        method: str,
        route: str,
        want: int,
        token: str | None = None,
        *,
        path: str | None = None,
        **kw: Any,
    ) -> httpx.Response:
        headers = {**kw.pop("headers", {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        r = self.http.request(method, path or route, headers=headers, **kw)
        assert r.status_code == want, (method, path or route, r.status_code, r.text)
        op = self.doc["paths"][route][method.lower()]
        declared = op["responses"].get(str(r.status_code))
        assert declared is not None, f"{method} {route} answered {r.status_code}, not in the document"
        content = declared.get("content", {})
        if r.headers["content-type"].startswith("application/json"):
            schema = content["application/json"]["schema"]
            jsonschema.validate(
                r.json(),
                {**schema, "components": self.doc["components"]},
                cls=jsonschema.Draft202012Validator,
            )
        else:
            assert "text/plain" in content, (route, r.headers["content-type"])
        self.seen.add((method.lower(), route, str(r.status_code)))
        return r


def test_the_document_is_valid_and_every_answer_matches_it(plane):
    doc = httpx.get(plane.url + "/openapi.json").json()
    validate(doc)
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a tenant's token (TIDAL_TOKEN)",
    }
    gpus = doc["components"]["schemas"]["JobSpec"]["properties"]["gpus"]["anyOf"]
    assert {"minimum": 1, "maximum": 65536, "type": "integer"} in gpus  # gpus: 1 is accepted, and declared
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert all(p["name"].lower() != "authorization" for p in op.get("parameters", []))
            if path.startswith("/v1") or path == "/metrics":
                assert op["security"] == [{"bearer": []}] and "401" in op["responses"], (method, path)

    call = Checked(plane.url, doc)
    admin = plane.admin.token
    call("GET", "/healthz", 200)
    call("GET", "/v1/whoami", 401)
    call("GET", "/v1/whoami", 401, "tidal_wrong")
    call("GET", "/v1/whoami", 200, admin)
    lab = call("POST", "/v1/tenants", 201, admin, json={"name": "lab", "quota_gpus": 1}).json()["token"]
    call("POST", "/v1/tenants", 409, admin, json={"name": "lab"})
    call("POST", "/v1/tenants", 422, admin, json={"name": "no spaces"})
    call("POST", "/v1/tenants", 403, lab, json={"name": "x"})
    call(
        "POST",
        "/v1/tenants",
        413,
        admin,
        content=b"{" + b" " * (2 << 20) + b"}",
        headers={"Content-Type": "application/json"},
    )
    call("GET", "/v1/tenants", 200, admin)
    call("GET", "/v1/tenants", 403, lab)

    spec = {"name": "ok", "gpus": 1, "command": [sys.executable, "-c", "print('hi')"]}
    job = call("POST", "/v1/jobs", 201, lab, json=spec).json()["id"]
    call("POST", "/v1/jobs", 422, lab, json={**spec, "gpus": 0, "command": "python x.py"})
    call("POST", "/v1/jobs", 400, lab, content=b"{not json", headers={"Content-Type": "application/json"})
    call("POST", "/v1/jobs", 413, lab, content=b"[" + b"1," * (1 << 20) + b"1]")
    wait_until("the job to succeed", lambda: plane.admin.job(job)["state"] == "succeeded")
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    big = call(
        "POST", "/v1/jobs", 201, lab, json={**spec, "name": "big", "gpus": {"min": 2}, "command": sleep}
    )
    waiting = call("POST", "/v1/jobs", 201, lab, json={**spec, "name": "small", "command": sleep}).json()[
        "id"
    ]
    call("GET", "/v1/jobs", 200, lab)
    call("GET", "/v1/jobs", 422, lab, path="/v1/jobs?state=nonsense")
    wait_until("a reason", lambda: plane.admin.job(waiting)["waiting"])
    for j in (job, big.json()["id"], waiting):
        call("GET", "/v1/jobs/{job_id}", 200, lab, path=f"/v1/jobs/{j}")
    call("GET", "/v1/jobs/{job_id}", 404, lab, path="/v1/jobs/nope-1")
    call("GET", "/v1/jobs/{job_id}/logs", 200, lab, path=f"/v1/jobs/{job}/logs")
    call("GET", "/v1/jobs/{job_id}/logs", 404, lab, path=f"/v1/jobs/{job}/logs?rank=5")
    call("GET", "/v1/jobs/{job_id}/logs", 422, lab, path=f"/v1/jobs/{job}/logs?offset=-1")
    call("GET", "/v1/jobs/{job_id}/checkpoints", 200, lab, path=f"/v1/jobs/{job}/checkpoints")
    call("GET", "/v1/jobs/{job_id}/checkpoints", 404, lab, path="/v1/jobs/nope-1/checkpoints")
    call("GET", "/v1/events", 200, lab, path=f"/v1/events?job={job}")
    call("GET", "/v1/events", 200, admin)
    call("GET", "/v1/events", 404, lab, path="/v1/events?job=nope-1")
    call("GET", "/v1/events", 422, lab, path="/v1/events?limit=0")
    call("GET", "/v1/pool", 200, lab)
    call("GET", "/v1/serving", 404, lab)
    call("POST", "/v1/jobs/{job_id}/cancel", 409, lab, path=f"/v1/jobs/{job}/cancel")
    call("POST", "/v1/jobs/{job_id}/cancel", 200, lab, path=f"/v1/jobs/{waiting}/cancel")
    call("POST", "/v1/jobs/{job_id}/cancel", 200, lab, path=f"/v1/jobs/{big.json()['id']}/cancel")
    call("POST", "/v1/jobs/{job_id}/cancel", 404, lab, path="/v1/jobs/nope-1/cancel")
    call("GET", "/metrics", 200, admin)
    call("GET", "/metrics", 403, lab)
    call("GET", "/metrics", 401)

    every = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert every == {(m, p) for m, p, _ in call.seen}, every - {(m, p) for m, p, _ in call.seen}
