"""The web dashboard: one static page and its script, served by the gateway.

The page holds no data of its own: its script reads the `/plexrl/v1` API with the API key
the user gives it, like any other client, so it sees exactly what that key may see.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from plexrl_gateway.errors import not_found

router = APIRouter(include_in_schema=False)

_ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# Nothing outside the gateway is reachable from a cluster, so the page loads nothing from
# anywhere else; the policy makes a stray external reference fail loudly in development.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


@cache
def _read(name: str) -> bytes:
    return (resources.files("plexrl_gateway") / "static" / name).read_bytes()


def _asset(name: str) -> Response:
    return Response(
        _read(name),
        media_type=_ASSETS[name],
        # Small files that change with a deploy: revalidate rather than serve a stale script.
        headers={"cache-control": "no-cache", "content-security-policy": _CSP},
    )


@router.get("/")
async def index() -> RedirectResponse:
    return RedirectResponse("/dashboard", status_code=307)


@router.get("/dashboard")
async def dashboard() -> Response:
    return _asset("dashboard.html")


@router.get("/dashboard/{name}")
async def asset(name: str) -> Response:
    if name not in _ASSETS:
        raise not_found(f"no dashboard file {name!r}; the page is at /dashboard")
    return _asset(name)
