"""The gateway's components, built once and shared by every route."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from plexrl.dead_letters import DeadLetters
from plexrl.health import Watched
from plexrl.lease import SCHEDULER, holder_of, lease_key
from plexrl.limits import DEFAULT_LIMITS, CallLimits
from plexrl.models import ModelRegistry
from plexrl.settings import GatewaySettings
from plexrl.state_store_client import StateStoreClient
from plexrl.stores import CallStore, PayloadStore, RedisKeys, Stores, TimelineStore, UsageStore
from plexrl.stores.tenant_records import TenantRecords
from plexrl.topics import Topics
from plexrl_gateway.accepted import AcceptedCalls
from plexrl_gateway.admission import CountingPublisher, PendingCalls
from plexrl_gateway.auth import ApiKeys
from plexrl_gateway.catalog import ModelCatalog
from plexrl_gateway.checkpoints import CheckpointRemover
from plexrl_gateway.cluster import ClusterView
from plexrl_gateway.exports import ExportFiles
from plexrl_gateway.futures import FutureWaiter
from plexrl_gateway.outbox import Outbox
from plexrl_gateway.placement import Placement
from plexrl_gateway.registry import Registry
from plexrl_gateway.sequencer import Sequencer
from plexrl_gateway.session_trace import SessionTraces
from plexrl_gateway.signing import UrlSigner, signing_secret
from plexrl_gateway.submitter import RequestPublisher, Submitter


async def _no_replicas() -> int:
    return 0


async def advertised_leader(keys: RedisKeys) -> str | None:
    """The URL the leading scheduler advertises in its lease (None: nobody leads)."""
    holder = await holder_of(keys.redis, lease_key(keys.key, SCHEDULER))
    return holder.advertised if holder else None


@dataclass(frozen=True)
class Gateway:
    keys: ApiKeys
    """X-API-Key → tenant."""
    calls: CallStore
    """Future records and completions (and whether Redis answers)."""
    payloads: PayloadStore
    """Results that came by reference."""
    timeline: TimelineStore
    """Which call ran where and when."""
    usage: UsageStore
    """Each job's device-time counters."""
    catalog: ModelCatalog
    placement: Placement
    """Base models by name."""
    registry: Registry
    """Sessions, jobs and checkpoints, per tenant."""
    submitter: Submitter
    """Future records, retry dedupe, ordering, Kafka."""
    sequencer: Sequencer
    """Each training model's seq_id order (the submitter's; refusals use seq_ids up)."""
    futures: FutureWaiter
    """Long-polls for completions."""
    publisher: RequestPublisher
    """Kafka producer (also for idle hints)."""
    topics: Topics
    cluster: ClusterView
    """Workers, scheduler status, job accounting."""
    checkpoints: CheckpointRemover
    """Checkpoint deletion through the state-store."""
    future_wait_s: float
    """Longest one retrieve_future holds before answering 'try again'."""
    dead_letters: DeadLetters
    """Answers the callers of unreadable messages; lists a tenant's dead letters."""
    exports: ExportFiles
    """Exported weights: who may read them, their signed URLs, their files' bytes."""
    traces: SessionTraces
    """Sessions' calls as Perfetto traces, behind signed URLs."""
    watched: list[Watched] = field(default_factory=list)
    """Consumer loops whose death or stall makes /healthz answer 503."""

    limits: CallLimits = DEFAULT_LIMITS
    """Per-call admission caps (plexrl.limits)."""
    pending: PendingCalls = field(default_factory=lambda: PendingCalls(DEFAULT_LIMITS))
    """Each tenant's published, unanswered calls; the 429 quota."""
    replicated: Callable[[], Awaitable[int]] = field(default=_no_replicas)
    """Waits until Redis's replicas hold this process's writes (`RedisKeys.replicated`):
    a request that wrote is answered only then (plexrl_gateway.replicas)."""

    def watch(self, consumer: Watched) -> None:
        self.watched.append(consumer)

    @classmethod
    def build(
        cls,
        settings: GatewaySettings,
        stores: Stores,
        publisher: RequestPublisher,
        limits: CallLimits = DEFAULT_LIMITS,
    ) -> Gateway:
        """Every component over its own stores, all on one Redis connection."""
        topics = Topics(settings.cluster_id)
        pending = PendingCalls(limits)
        accepted = AcceptedCalls()
        publisher = CountingPublisher(publisher, pending, topics.requests)
        sequencer = Sequencer(stores.calls, settings.sequence_gap_timeout_s)
        signer = UrlSigner(signing_secret(settings.url_signing_secret, settings.service_token))
        registry = Registry(
            stores.sessions,
            stores.jobs,
            stores.checkpoints,
            TenantRecords(stores.keys),
            settings.quotas(),
        )
        return cls(
            keys=ApiKeys(settings.api_keys),
            calls=stores.calls,
            payloads=stores.payloads,
            timeline=stores.timeline,
            usage=stores.usage,
            catalog=ModelCatalog(ModelRegistry(settings.model_registry)),
            placement=Placement(stores.workers, settings.worker_timeout_s),
            registry=registry,
            submitter=Submitter(
                stores.calls,
                stores.payloads,
                Outbox(stores.keys),
                publisher,
                topics,
                sequencer,
                settings.payload_inline_max_bytes,
                accepted=accepted,
            ),
            sequencer=sequencer,
            futures=FutureWaiter(stores.calls, on_answered=pending.done, accepted=accepted),
            publisher=publisher,
            topics=topics,
            cluster=ClusterView(
                jobs=stores.jobs,
                workers=stores.workers,
                residency=stores.residency,
                usage=stores.usage,
                scheduler_url=settings.scheduler_url,
                service_token=settings.service_token,
                leader_url=functools.partial(advertised_leader, stores.keys),
            ),
            checkpoints=CheckpointRemover(
                stores.checkpoints, settings.state_store_url, settings.service_token
            ),
            future_wait_s=settings.future_wait_s,
            dead_letters=DeadLetters(stores.calls, stores.keys, publisher, topics.completions),
            exports=ExportFiles(
                stores.checkpoints,
                StateStoreClient(
                    settings.state_store_url,
                    timeout_s=settings.state_store_timeout_s,
                    token=settings.service_token,
                ),
                signer,
                settings.export_url_ttl_s,
                settings.public_url,
            ),
            traces=SessionTraces(
                registry,
                stores.timeline,
                signer,
                settings.export_url_ttl_s,
                settings.public_url,
            ),
            limits=limits,
            pending=pending,
            replicated=stores.keys.replicated,
        )

    async def close(self) -> None:
        await self.cluster.close()
        await self.checkpoints.close()
        await self.exports.close()
