"""Where each job's state is, moved only by compare-and-set on its version."""

from __future__ import annotations

import msgspec

from plexrl.messages import Tier
from plexrl.stores.redis import RedisKeys, RedisStore


class Residency(msgspec.Struct, frozen=True):
    """Where one job's state is; writes are compare-and-set on `version`."""

    worker_id: str
    tier: Tier
    bytes: int
    version: int
    updated_at: float


# Compare-and-set of a residency record: ARGV = expected version, new record. The record
# is JSON (not msgpack) so the script can read its version.
_CAS_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
local expected = tonumber(ARGV[1])
if cur == false then
  if expected ~= 0 then return 0 end
else
  local v = cjson.decode(cur)['version']
  if v ~= expected then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


class ResidencyStore(RedisStore):
    """`residency:<job>`: two actors can never both believe they own a job's state."""

    def __init__(self, keys: RedisKeys) -> None:
        super().__init__(keys)
        self._cas = self._redis.register_script(_CAS_SCRIPT)

    async def get_residency(self, job_id: str) -> Residency | None:
        raw = await self._redis.get(self._k("residency", job_id))
        return None if raw is None else msgspec.json.decode(raw, type=Residency)

    async def cas_residency(self, job_id: str, expected_version: int, new: Residency) -> bool:
        """Write `new` only if the stored version is `expected_version` (0: absent)."""
        ok = await self._cas(
            keys=[self._k("residency", job_id)],
            args=[expected_version, msgspec.json.encode(new)],
        )
        return bool(ok)

    async def drop_residency(self, job_id: str) -> None:
        await self._redis.delete(self._k("residency", job_id))
