"""Schemathesis hooks for tests/test_fuzz_api.py (loaded by ``st run`` through ``SCHEMATHESIS_HOOKS``).

A schema-valid job spec may still be refused for what the plane holds now (its pool, the tenant's quota
and limits, other jobs' checkpoint locations) or by the tier grammar: such a 422 names only error types
of ``tidal.control.api.UNDECLARED_RULES``. Any other 422 of a schema-valid request is a rule missing from the
schema, and fails as schemathesis's own ``positive_data_acceptance`` (which the test turns off) would."""

from __future__ import annotations

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tidal.control.api import UNDECLARED_RULES


@schemathesis.check
def valid_data_accepted_unless_state_refuses(ctx, response, case):
    if response.status_code == 422:
        try:
            types = {e["type"] for e in response.json()["detail"]}
        except (ValueError, KeyError, TypeError):
            types = set()
        if types and types <= UNDECLARED_RULES:
            return None
    return positive_data_acceptance(ctx, response, case)
