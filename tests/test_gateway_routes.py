"""The gateway's routers are matched in an order chosen for speed (the routes every call
takes first), which is safe only while no two routers have routes for one method and
path: then whichever order, a request reaches the same route."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gateway_harness import gateway
from starlette.routing import Match

from plexrl_gateway.app import build_app

pytestmark = pytest.mark.integration


async def test_no_two_routers_answer_one_method_and_path(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry) as gw:
        app = build_app(gw.gateway)
    routers = app.router.routes
    checked = 0
    for position, router in enumerate(routers):
        original = getattr(router, "original_router", None)
        for route in original.routes if original is not None else [router]:
            path = getattr(route, "path", None)
            if path is None:
                continue
            # Each parameter filled in; a `:path` one with a slash too.
            sample = re.sub(r"\{[^}:]*:path\}", "a/b", path)
            sample = re.sub(r"\{[^}]*\}", "a", sample)
            for method in getattr(route, "methods", None) or {"GET"}:
                scope = {
                    "type": "http",
                    "method": method,
                    "path": sample,
                    "root_path": "",
                    "headers": [],
                    "query_string": b"",
                }
                answering = [i for i, r in enumerate(routers) if r.matches(scope)[0] == Match.FULL]
                assert answering == [position], (method, path, answering)
                checked += 1
    assert checked > 40  # every router's routes were there to check
