"""How internal services authenticate to each other: one shared token, sent as a bearer.

The token is `PLEXRL_SERVICE_TOKEN`, the same for every service of a cluster; tenants
never hold it (they hold API keys, which only the gateway reads). A service acting for
a tenant also names the tenant (`X-PlexRL-Tenant`), so the state-store can keep each
tenant's checkpoints apart even among trusted callers. docs/security.md has the
whole trust boundary.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets

TENANT_HEADER = "x-plexrl-tenant"
"""The tenant a service call acts for."""


def auth_headers(token: str | None, tenant: str | None = None) -> dict[str, str]:
    """Headers of an internal call: the bearer token (when the cluster has one) and the
    tenant it acts for (when it acts for one)."""
    headers: dict[str, str] = {}
    if token:
        headers["authorization"] = f"Bearer {token}"
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
    return headers


def bearer_matches(expected: str, authorization: str | None) -> bool:
    """Whether an `Authorization` header carries the token; compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A fresh token (for a local cluster that makes its own)."""
    return secrets.token_urlsafe(32)
