"""API keys to tenants: every call names its tenant with `X-API-Key`."""

from __future__ import annotations

from plexrl.settings import parse_api_keys
from plexrl_gateway.errors import ApiError


class ApiKeys:
    def __init__(self, spec: str) -> None:
        self._tenants = parse_api_keys(spec)

    def tenant(self, key: str | None) -> str:
        """The key's tenant; 401 when the key is missing or unknown."""
        if not key:
            raise ApiError(401, "missing X-API-Key header; send the API key you were given")
        tenant = self._tenants.get(key)
        if tenant is None:
            raise ApiError(401, "unknown API key; check TINKER_API_KEY")
        return tenant
