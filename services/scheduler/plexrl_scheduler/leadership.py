"""Which of the cluster's schedulers leads: the `scheduler` lease (plexrl.lease).

Every scheduler process runs this; the one holding the lease leads (consumes the
requests, decides, dispatches), the others wait as standbys, answering their health
checks and asking for the lease every half second. A term's token fences what its
leader writes and sends: the ledger refuses its call numbers and epochs once a newer
term began, and every dispatch carries it (`Dispatch.leader_token`), so a worker skips
one from a deposed leader (`plexrl_worker.leader.LeaderFence`).
"""

from __future__ import annotations

import socket
from typing import Any

from plexrl.lease import SCHEDULER, Fence, Lead, Leadership, Lease, LeaseConfig, Term, lease_key
from plexrl.settings import SchedulerSettings
from plexrl.stores import RedisKeys


class SchedulerLeadership:
    def __init__(self, keys: RedisKeys, settings: SchedulerSettings) -> None:
        self.url = (
            settings.scheduler_advertise_url
            or f"{settings.http_scheme}://{settings.scheduler_host}:{settings.scheduler_port}"
        )
        # Host names repeat (containers, network namespaces); the address does not.
        where = self.url.removeprefix("http://").removeprefix("https://")
        self.name = settings.scheduler_id or f"{socket.gethostname()}@{where}"
        ttl = settings.leader_lease_s
        self.lease = Lease(
            keys.redis,
            lease_key(keys.key, SCHEDULER),
            holder=self.name,
            advertised=self.url,
            config=LeaseConfig(ttl_s=ttl, renew_s=min(1.0, ttl / 4), retry_s=0.5, margin_s=0.5),
            replicated=keys.replicated,
        )
        self._leadership = Leadership(self.lease)

    async def run(self, stop: Any, lead: Lead) -> None:
        """Lead whenever this scheduler holds the lease, until `stop`."""
        await self._leadership.run(stop, lead)

    def fence(self, term: Term) -> Fence:
        return self.lease.fence(term)

    def status(self) -> dict[str, Any]:
        """This scheduler's role, for /healthz (a standby says who leads)."""
        term = self._leadership.term
        if term is not None:
            return {"role": "leader", "scheduler": self.name, "token": term.token}
        seen = self._leadership.seen
        return {
            "role": "standby",
            "scheduler": self.name,
            "leader": seen.holder if seen else None,
            "leader_url": seen.advertised if seen else None,
            "terms_led": self._leadership.terms,
        }
