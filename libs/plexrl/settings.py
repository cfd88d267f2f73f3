"""Environment settings, one class per service; each reads only `PLEXRL_*` variables.

Internal tunables (policy, engine) are dataclasses next to the code they tune;
these classes hold only what an operator sets per deployment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from plexrl.kafka_replication import TopicReplication
from plexrl.kafka_security import KafkaSecurity, Mechanism, Protocol
from plexrl.policy.costs import LEARN_SAMPLES, MAX_TAIL_SHARE, SharingCosts
from plexrl.quotas import DEFAULT_QUOTAS, RecordQuotas


class CommonSettings(BaseSettings):
    """What every service needs to find the cluster."""

    model_config = SettingsConfigDict(env_prefix="PLEXRL_", extra="ignore")

    # Kafka bootstrap servers, comma separated.
    kafka_bootstrap: str = "127.0.0.1:9092"
    # Copies of each partition of the topics the services create: 1 on one broker; 3 on
    # a cluster of three or more brokers on separate hosts (docs/deploy.md), so losing a
    # broker's host loses no message. Topics made earlier keep their factor (a warning
    # says so).
    kafka_replication_factor: int = Field(default=1, ge=1)
    # The topics' `min.insync.replicas`: copies that must hold a message before a send
    # (every producer uses acks=all, idempotent) succeeds. 1 with one copy; 2 with three,
    # so one broker can be down without refusing sends and an acknowledged message is on
    # two brokers. At most kafka_replication_factor.
    kafka_min_insync_replicas: int = Field(default=1, ge=1)
    # What every Kafka client of the service speaks to the brokers: PLAINTEXT on one
    # machine or a private network; SSL (TLS) or SASL_SSL (TLS and a user) across a
    # shared one (docs/deploy.md, the trust boundary).
    kafka_security_protocol: Protocol = "PLAINTEXT"
    # PEM file of the CA that signed the brokers' certificates (unset: the system's).
    kafka_ssl_cafile: str | None = None
    # This service's client certificate and its unencrypted key (PEM), for brokers that
    # require one (`ssl.client.auth=required`).
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    # Whether a broker's certificate must name the address the service reaches it at.
    kafka_ssl_check_hostname: bool = True
    # The SASL mechanism, user and password of a SASL_SSL (or SASL_PLAINTEXT) listener.
    kafka_sasl_mechanism: Mechanism | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = None
    # Redis URL of the metadata store (no tensors live there). With Sentinels (below),
    # only its database number, user, password and scheme (rediss:// for TLS) count.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Sentinels that watch a Redis primary and its replicas, "host:port,host:port":
    # the services ask them where the primary is, and follow a failover by themselves.
    # Unset: PLEXRL_REDIS_URL is the server (one machine).
    redis_sentinels: str | None = None
    # The name the Sentinels monitor the primary under (`sentinel monitor <name> ...`).
    redis_sentinel_master: str = "plexrl"
    # Replicas a write must reach before it is shown outside Redis (an accepted call, a
    # recorded result, a call number, a lease), so that a failover cannot lose it (Redis
    # WAIT; docs/deploy.md says which writes wait). 0 on one machine; 1 with two replicas.
    redis_wait_replicas: int = Field(default=0, ge=0)
    # Longest such a write waits, milliseconds; past it the write is not confirmed and
    # its caller retries (logged, and counted in plexrl_redis_unreplicated_writes_total).
    redis_wait_timeout_ms: int = Field(default=1000, ge=1)
    # A Redis command unanswered this long fails and is sent again on a new connection
    # (a primary whose host vanished is given up on); 0: wait forever.
    redis_socket_timeout_s: float = Field(default=10.0, ge=0)
    # Opening a connection to Redis or a Sentinel fails after this long, seconds.
    redis_connect_timeout_s: float = Field(default=2.0, gt=0)
    # The share of API calls traced where spans are exported (OTEL_EXPORTER_OTLP_ENDPOINT):
    # 1 traces every call, 0.01 one in a hundred; the same on every service (a call's
    # trace is kept or dropped whole, docs/tracing.md).
    trace_ratio: float = Field(default=1.0, ge=0, le=1)
    # Base URL of the state-store service (checkpoints, disk tier); several replicas over
    # one object store may be listed, comma separated (plexrl.endpoints).
    state_store_url: str = "http://127.0.0.1:8300"
    # Seconds a state-store may stay silent in the middle of a request (between bytes)
    # before it is given up on (and the next replica tried next time).
    state_store_timeout_s: float = Field(default=30.0, gt=0)
    # Names this cluster: prefixes Kafka topics, consumer groups and Redis keys.
    # The default gives the design's topic names (`plexrl.requests`, ...).
    cluster_id: str = "plexrl"
    # Payloads whose encoding is larger than this go by reference (Redis, with a TTL).
    payload_inline_max_bytes: int = 512 * 1024
    # How long by-reference payloads, results and idempotency records live, seconds.
    record_ttl_s: int = 24 * 3600
    # Python log level.
    log_level: str = "INFO"
    # The service's event loop: uvloop (libuv's; the default where it is installed,
    # docs/control_plane.md measures it) or asyncio (the standard library's).
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # Shared secret internal services present to each other (`Authorization: Bearer ...`
    # to the state-store). Unset: the state-store serves only a loopback address, without
    # authentication, and refuses to start on any other (docs/security.md).
    service_token: str | None = None
    # Limits of this service's HTTP server (plexrl.health.HttpLimits): open connections at
    # most; beyond them a new connection gets a 503 and is closed.
    http_max_connections: int = Field(default=512, ge=1)
    # Open connections from one client address at most (a share of the above).
    http_max_connections_per_client: int = Field(default=128, ge=1)
    # Seconds a connection has for a request's line and headers, from when it opens or
    # its previous response ends; data trickling in does not extend it (slowloris).
    http_head_timeout_s: float = Field(default=10.0, gt=0)
    # Seconds a request has for its whole body once its headers are in, plus what the
    # bytes received so far take at http_min_body_bytes_per_s.
    http_body_timeout_s: float = Field(default=60.0, gt=0)
    # A body arriving at least this fast on average (bytes/s) keeps going past
    # http_body_timeout_s: a large state uploaded to the state-store takes longer.
    http_min_body_bytes_per_s: float = Field(default=float(1 << 20), gt=0)
    # Seconds an idle keep-alive connection is kept between requests.
    http_keep_alive_s: int = Field(default=5, ge=1)
    # Largest request line plus headers, bytes; a longer head is answered 431.
    http_max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    # This service's certificate and unencrypted key (PEM): set, it serves HTTPS on its
    # port (the API, /healthz, /metrics, the service token's routes), and the others
    # reach it at https:// URLs, trusting its CA through SSL_CERT_FILE (docs/deploy.md).
    # Unset: plain HTTP, for one machine or a private network.
    http_tls_certfile: str | None = None
    http_tls_keyfile: str | None = None

    @model_validator(mode="after")
    def _replication_fits(self) -> CommonSettings:
        self.topic_replication()  # raises saying what to change
        self.kafka_security()
        self._check_http_tls()
        self.sentinel_nodes()
        return self

    def sentinel_nodes(self) -> tuple[tuple[str, int], ...]:
        """PLEXRL_REDIS_SENTINELS as (host, port) pairs (none: no Sentinels)."""
        return parse_sentinels(self.redis_sentinels or "")

    def _check_http_tls(self) -> None:
        files = {"CERTFILE": self.http_tls_certfile, "KEYFILE": self.http_tls_keyfile}
        if (files["CERTFILE"] is None) != (files["KEYFILE"] is None):
            raise ValueError(
                "HTTPS needs both PLEXRL_HTTP_TLS_CERTFILE and PLEXRL_HTTP_TLS_KEYFILE "
                "(or neither, for plain HTTP)"
            )
        for name, path in files.items():
            if path is not None and not Path(path).is_file():
                raise ValueError(f"PLEXRL_HTTP_TLS_{name} {path} is not a file")

    @property
    def http_scheme(self) -> str:
        """What this service serves: https with a certificate, else http."""
        return "https" if self.http_tls_certfile else "http"

    def kafka_security(self) -> KafkaSecurity:
        return KafkaSecurity(
            protocol=self.kafka_security_protocol,
            cafile=self.kafka_ssl_cafile,
            certfile=self.kafka_ssl_certfile,
            keyfile=self.kafka_ssl_keyfile,
            check_hostname=self.kafka_ssl_check_hostname,
            sasl_mechanism=self.kafka_sasl_mechanism,
            sasl_username=self.kafka_sasl_username,
            sasl_password=self.kafka_sasl_password,
        )

    def topic_replication(self) -> TopicReplication:
        return TopicReplication(self.kafka_replication_factor, self.kafka_min_insync_replicas)


class GatewaySettings(CommonSettings):
    # Interface and port of the HTTP API.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    # API keys and their tenants: "tml-key1=tenant-a,tml-key2=tenant-b".
    api_keys: str = "tml-dev=dev"
    # Directory of local base models (see `plexrl model init-tiny`).
    model_registry: Path = Path(".plexrl/models")
    # Longest a `retrieve_future` call waits for a result before answering "try again";
    # keep it under the SDK's 45 s client timeout.
    future_wait_s: float = 25.0
    # Longest a training call waits for a lower seq_id of its model before failing.
    sequence_gap_timeout_s: float = 30.0
    # Base URL of the scheduler's health endpoint (queue depths for /plexrl/v1/cluster);
    # several schedulers may be listed, comma separated: the one that leads answers.
    scheduler_url: str = "http://127.0.0.1:8100"
    # A worker group silent this long is not counted when a new training model is checked
    # against the groups that could hold it (the scheduler's PLEXRL_WORKER_TIMEOUT_S).
    worker_timeout_s: float = Field(default=6.0, gt=0)
    # Per-tenant quotas on records and their user metadata (plexrl.quotas.RecordQuotas
    # says what each counts); a record past one is refused with a 400 naming it.
    # Client sessions alive at once.
    quota_sessions: int = Field(default=DEFAULT_QUOTAS.sessions, ge=1)
    # Training models loaded at once (unloading one frees its place).
    quota_training_models: int = Field(default=DEFAULT_QUOTAS.training_models, ge=1)
    # Sampling sessions kept.
    quota_sampling_sessions: int = Field(default=DEFAULT_QUOTAS.sampling_sessions, ge=1)
    # Checkpoints kept.
    quota_checkpoints: int = Field(default=DEFAULT_QUOTAS.checkpoints, ge=1)
    # Bytes of user_metadata (and tags) of one session or model.
    quota_record_metadata_bytes: int = Field(default=DEFAULT_QUOTAS.record_metadata_bytes, ge=1)
    # Bytes of user_metadata of all one tenant's records together.
    quota_metadata_bytes: int = Field(default=DEFAULT_QUOTAS.metadata_bytes, ge=1)
    # Seconds a signed download URL of exported weights is valid (get_external_weights_urls;
    # never past the checkpoint's own expiry). docs/export.md.
    export_url_ttl_s: float = Field(default=3600.0, gt=0)
    # Secret the gateway signs those URLs with (HMAC-SHA256). Unset: derived from
    # PLEXRL_SERVICE_TOKEN, so every gateway of a cluster accepts the others' URLs; with
    # neither set, a random one per gateway process (its URLs die with it).
    url_signing_secret: str | None = None
    # Base URL clients reach the gateway at (e.g. behind a proxy), for the signed URLs.
    # Unset: the URL the get_external_weights_urls call itself came to.
    public_url: str | None = None
    # Bytes of checkpoints one tenant stores (a save is refused once they reach it).
    quota_checkpoint_bytes: int = Field(default=DEFAULT_QUOTAS.checkpoint_bytes, ge=1)
    # Shortest checkpoint TTL accepted, seconds (the Tinker API's is one hour).
    checkpoint_ttl_min_s: int = Field(default=DEFAULT_QUOTAS.checkpoint_ttl_min_s, ge=1)

    def quotas(self) -> RecordQuotas:
        return RecordQuotas(
            sessions=self.quota_sessions,
            training_models=self.quota_training_models,
            sampling_sessions=self.quota_sampling_sessions,
            checkpoints=self.quota_checkpoints,
            record_metadata_bytes=self.quota_record_metadata_bytes,
            metadata_bytes=self.quota_metadata_bytes,
            checkpoint_bytes=self.quota_checkpoint_bytes,
            checkpoint_ttl_min_s=self.checkpoint_ttl_min_s,
        )


_GPU_COSTS = SharingCosts()
"""The costs of sharing the policy assumes for a GPU: the scheduler's defaults."""


class SchedulerSettings(CommonSettings):
    # Health and status port.
    scheduler_host: str = "127.0.0.1"
    scheduler_port: int = 8100
    # Scheduling policy name (see `plexrl.policy.POLICIES`): the project's own by default
    # (README, "Scheduling policies"); `fifo` is the plain baseline.
    policy: str = "plexrl"
    # Most consecutive calls of one job sent to a worker in one dispatch.
    max_calls_per_run: int = 8
    # Dispatches in flight per worker at most: the running job's next calls follow its
    # dispatch at once when no other job waits for that worker (plexrl_scheduler.pipeline).
    # 1: one dispatch at a time, the next decided when it ends.
    dispatch_depth: int = Field(default=2, ge=1)
    # The plexrl policy's placement (`PolicyConfig.pack`): false for a fixed pool, whose
    # workers are held whether they run anything or not (new jobs go where they slow
    # the others least); true packs jobs onto the fullest worker within the slowdown
    # budget, so whole workers stay free (worth it only if idle workers are released).
    pack_groups: bool = False
    # The plexrl policy's admission order (`PolicyConfig.longest_first`): while jobs wait
    # for a worker, the one with the most declared work (its `steps` option) goes first;
    # jobs that declared nothing follow in arrival order. False: arrival order.
    admit_longest_first: bool = True
    # With `pack_groups`, the plexrl policy's guard on newcomers (`PolicyConfig.
    # bound_newcomers`): a job without a history of its own joins a shared worker only if
    # everyone there would stay within twice the slowdown budget were it as busy as its
    # kind's busiest tenth. False: its kind's mean alone decides.
    bound_newcomers: bool = True
    # With `pack_groups`, what the plexrl policy holds within the slowdown budget
    # (`PolicyConfig.budget_over_cluster`): the mean predicted slowdown of every homed
    # job (those alone at 0) with the new one; false: of the worker it joins.
    budget_over_cluster: bool = True
    # The plexrl policy's anticipation (`PolicyConfig.hold_s`): a worker whose last job
    # is in a burst of calls (its last gap between calls at most this) waits up to twice
    # that gap, at most this, for that job's next call before serving another job. 0: off.
    hold_s: float = 0.1
    # The plexrl policy's preemption (`PolicyConfig.preempt_ratio`): a worker's running
    # sample batch yields to a waiting job whose calls are expected to take at most this
    # fraction of the batch's remaining seconds (once per batch). 0: off.
    preempt_ratio: float = Field(default=0.5, ge=0.0, le=1.0)
    # The plexrl policy's prefetch (`PolicyConfig.prefetch`): while a worker runs one
    # job's calls, the state of the job most likely next there is brought onto its device.
    prefetch: bool = True
    # Co-sampling (`PolicyConfig.max_cosampled_calls`): a dispatch of sample calls takes
    # other jobs' sample calls waiting on its worker along, up to this many calls in all,
    # decoded in one batch (each call's output as alone). 0: off.
    max_cosampled_calls: int = Field(default=32, ge=0)
    # The plexrl policy's tenant share (`PolicyConfig.fair_share`): where several tenants'
    # jobs share a worker, the one that used it least lately goes first (one turn each),
    # a dispatch beside another tenant holds about one long call, and new jobs are homed
    # away from other tenants' load. False: tenant-blind placement, tenants in turns.
    fair_share: bool = True
    # The plexrl policy's roaming samples (`PolicyConfig.roam`): a sample call on saved
    # sampler weights whose home worker is busy may run on an idle worker serving the
    # same base model (an asynchronous job samples there while it trains at home).
    roam_samples: bool = True
    # The plexrl policy's re-homing (`PolicyConfig.rehome`): a job homed on its kind's
    # figures is placed again, once, when it has its own, and moves between calls where
    # that pays (its new home restores it from its snapshot and logged calls).
    rehome: bool = True
    # With re-homing, a job whose last neighbour left its worker is reviewed again
    # (`PolicyConfig.rehome_lone`): packing, it joins a job alone on another worker
    # where both stay within the budget, and its worker is freed.
    rehome_lone: bool = True
    # With that, every review interval a job alone on its worker that another job alone
    # could take within the budget is reviewed again (`PolicyConfig.review_alone`): a
    # pair refused when one of them was left alone may fit on what they learned since.
    review_alone: bool = True
    # A newcomer's home is reviewed once it has this many times the history (5 s) its
    # own figures need (`PolicyConfig.review_histories`): early figures are noisy.
    review_histories: float = Field(default=8.0, ge=1.0)
    # A job that has made no call for this long, has none waiting or running and no idle
    # hint in force is taken to have stopped (a finished run, a closed client): it keeps
    # its worker and its state but adds no load where jobs are placed, until its next
    # call. Keep it above the longest stall a job makes without an idle hint.
    dormant_s: float = Field(default=60.0, gt=0.0)
    # What sharing a worker costs beyond moving states, which the plexrl policy predicts
    # placement and admission with (`plexrl.policy.costs.SharingCosts`): the seconds a
    # worker spends when a dispatch's job is not its previous one's (engine switch), the
    # least share of the worker a released rollout's stragglers hold beside another job's
    # calls, and how many times slower they decode then. Set them from measurements of
    # the pool's workers (`bench/tail_cost.py`); the defaults are assumptions for a GPU.
    sharing_switch_s: float = Field(default=_GPU_COSTS.switch_s, ge=0.0)
    sharing_tail_min_share: float = Field(
        default=_GPU_COSTS.tail_min_share, ge=0.0, lt=MAX_TAIL_SHARE
    )
    sharing_tail_contention: float = Field(default=_GPU_COSTS.tail_contention, ge=1.0)
    # The workers measure these costs on their own calls and say so in their heartbeats:
    # once the pool's workers together measured a cost this many times, the policy
    # predicts with their mean instead of the setting above. 0: the settings' costs only.
    sharing_learn_samples: int = Field(default=LEARN_SAMPLES, ge=0)
    # A worker whose last heartbeat is older than this is treated as down (its jobs
    # are re-homed and restored elsewhere). Heartbeats come every second; a false alarm
    # costs a restore, never a wrong result (the old home is fenced off).
    worker_timeout_s: float = 6.0
    # A dispatch whose worker reports idle this long after it was sent was lost: its
    # calls are requeued (see plexrl_scheduler.liveness.LivenessConfig).
    lease_grace_s: float = 5.0
    # This scheduler's name in the leader lease. Several schedulers run, one leads at a
    # time (docs/deploy.md); unset: <host name>@<its advertised address>.
    scheduler_id: str | None = None
    # The URL others reach this scheduler's /status at while it leads, advertised in the
    # lease; unset: http://<scheduler_host>:<scheduler_port> (set it when binding 0.0.0.0).
    scheduler_advertise_url: str | None = None
    # Seconds a leader's lease lasts without a renewal (renewed every second): a leader
    # killed or cut off is replaced after about this long plus the new leader's start.
    leader_lease_s: float = Field(default=4.0, gt=2.0)
    # Direct leases (plexrl.direct): a resident, active job's calls go from the gateways
    # straight to its worker while the scheduler renews its lease; this is how long one
    # holds unrenewed (gateways stop sending direct at most this long after the scheduler
    # stops renewing). 0 sends every call through the scheduler.
    direct_lease_s: float = Field(default=3.0, ge=0.0)

    def sharing(self) -> SharingCosts:
        """The costs of sharing the plexrl policy predicts with (`PolicyConfig.sharing`)."""
        return SharingCosts(
            switch_s=self.sharing_switch_s,
            tail_min_share=self.sharing_tail_min_share,
            tail_contention=self.sharing_tail_contention,
        )


class WorkerSettings(CommonSettings):
    # This worker group's id; its dispatch topic is `<cluster>.dispatch.<id>`.
    worker_id: str = "worker-0"
    # Health port.
    worker_host: str = "127.0.0.1"
    worker_port: int = 8200
    # Torch device for the engine: "cpu", "cuda", "cuda:1". In a group of several ranks:
    # "cpu", or "cuda" (rank r of this host on cuda:r); a rank started on another host
    # names its own device ("cuda:k").
    worker_device: str = "cpu"
    # Intra-op threads of torch on CPU, per rank; set it when several processes share the
    # cores (torch's default, one per core, is several times slower when oversubscribed).
    worker_threads: int | None = None
    # Bytes of device memory job states may use on each rank (base weights excluded): a
    # group of N ranks holds a job whose shard of its state fits one rank's.
    worker_device_bytes: int = Field(default=2 * 1024**3)
    # Bytes of host memory for offloaded job states, per rank; beyond it states go to disk.
    worker_host_bytes: int = Field(default=8 * 1024**3)
    # Ranks in this worker group (PLEXRL_WORKER_RANKS): one process and one device each,
    # training sharded over them with FSDP2, sampling data-parallel. 1: this process alone.
    worker_ranks: int = Field(default=1, ge=1)
    # Ranks this host starts: the leader (rank 0) and the next ones. The others are
    # started on their own hosts with PLEXRL_WORKER_RANK set. None: every rank here.
    worker_local_ranks: int | None = Field(default=None, ge=1)
    # Which rank this process is: 0 leads the group (the service itself); a process
    # started with a higher rank only joins its leader's group (a rank on another host).
    worker_rank: int = Field(default=0, ge=0)
    # Where the leader serves the group's rendezvous (a TCP store) and where ranks on other
    # hosts reach it. Port 0 picks a free one, which only ranks on this host can find.
    worker_rendezvous_host: str = "127.0.0.1"
    worker_rendezvous_port: int = Field(default=0, ge=0, le=65535)
    # The longest a rank waits for a peer in a collective: a hung rank is found lost after
    # this long (a dead one at once). Keep it above the longest call one rank computes.
    worker_collective_timeout_s: float = Field(default=120.0, gt=0)
    # Directory of local base models.
    model_registry: Path = Path(".plexrl/models")
    # Seconds between heartbeats.
    heartbeat_s: float = 1.0
    # Snapshot a job to the disk tier after this many state-changing calls (a restore
    # replays at most this many); see plexrl_worker.recovery.SnapshotConfig.
    snapshot_every_calls: int = 4
    # Move a job's call results from Redis to an archive blob beside its snapshot once
    # this many have gathered (and when the job ends): fewer, larger archives.
    results_archive_calls: int = Field(default=64, ge=1)
    # Ephemeral sampler snapshots (`save_weights_and_get_sampling_client`) kept per job:
    # each save retires the job's older ones beyond this many (record and blob), and
    # unloading the job retires them all. A sampling client over a retired one gets a
    # 404 saying so; a named `save_weights_for_sampler` is kept until deleted.
    ephemeral_keep: int = Field(default=8, ge=1)
    # Release the worker to its next dispatch once fewer than this fraction of a sample
    # batch's sequences still decode (the rollout-tail release; 0 turns it off). The
    # simulator's `tail_threshold` means the same; 0.25 is its `PHYSICAL_TAIL`.
    tail_threshold: float = Field(default=0.25, ge=0.0, lt=1.0)
    # Run each numbered forward_backward a micro-batch at a time (every rank of a group in
    # step), so the scheduler may preempt an asynchronous job's training between two of
    # them for a neighbour's sample (PLEXRL_SLICE_TRAINING; results are the whole call's).
    slice_training: bool = True
    # Tokens of one training micro-batch, padding included (rows x longest row): a
    # forward_backward's data is cut into micro-batches of at most this many, which
    # bounds its memory and is the slice a preempted call pauses after.
    worker_max_batch_tokens: int = Field(default=16384, ge=1)
    # What runs `sample` calls (PLEXRL_SAMPLER): `torch`, the engine's co-batching loop,
    # or `sglang`, an SGLang server per base model (scripts/sglang.sh installs it).
    sampler: Literal["torch", "sglang"] = "torch"
    # An SGLang server that runs already (PLEXRL_SGLANG_URL, e.g. a sidecar container):
    # the worker attaches to it instead of starting one, and never restarts or stops it.
    # It must serve the worker's one base model with LoRA on (checked at start).
    sglang_url: str | None = None
    # Where the SGLang sampler writes adapters, pushed weights and its servers' logs.
    sglang_dir: Path = Path(".plexrl/sglang-work")
    # Whether SGLang hands the device to training (PLEXRL_SGLANG_YIELD): `training`
    # releases its weights and KV cache before each training call that finds no sample
    # running and takes them back before the next sample; `never` keeps them; `auto`
    # is `training` on an accelerator and `never` on CPU, where the "device" is host
    # memory and a release frees nothing.
    sglang_yield: Literal["auto", "training", "never"] = "auto"


class StateStoreSettings(CommonSettings):
    state_store_host: str = "127.0.0.1"
    state_store_port: int = 8300
    # Directory of the disk tier: checkpoints and offloaded states as safetensors (one
    # machine: one state-store over one disk). Unused with an object store (below).
    state_store_dir: Path = Path(".plexrl/blobs")
    # An S3-compatible object store for the disk tier instead (its endpoint URL, e.g.
    # http://10.0.0.6:8333 for SeaweedFS's S3 gateway): state-store replicas on several
    # hosts share it (docs/deploy.md). Unset: state_store_dir.
    state_store_s3_endpoint: str | None = None
    # Its bucket (created if missing) and a prefix before every key, so that several
    # clusters can share a bucket ("cluster-a/").
    state_store_s3_bucket: str = "plexrl"
    state_store_s3_prefix: str = ""
    state_store_s3_region: str = "us-east-1"
    # Credentials; unset: boto3's own chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,
    # a profile, an instance or pod role).
    state_store_s3_access_key: str | None = None
    state_store_s3_secret_key: str | None = None
    # This replica's name, for the lease its background rounds run under (one replica
    # sweeps at a time; every replica serves). Unset: <host name>@<host>:<port>.
    state_store_id: str | None = None
    # Seconds between checks that every checkpoint record kept beside its blob is in
    # Redis (records Redis lost are put back; also done at start).
    state_store_rebuild_s: float = 30.0
    # Seconds between sweeps that delete checkpoints past their TTL (an expired one reads
    # as gone at once; the sweep frees its blob and record).
    state_store_expiry_sweep_s: float = Field(default=60.0, gt=0)


_TENANT = re.compile(r"[A-Za-z0-9._@=+-]+")


def parse_api_keys(spec: str) -> dict[str, str]:
    """Parse "key=tenant,key2=tenant2"; raises ValueError saying which entry is wrong."""
    keys: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        key, sep, tenant = entry.partition("=")
        if not sep or not key.strip() or not tenant.strip():
            raise ValueError(
                f"PLEXRL_API_KEYS entry {entry!r} is not of the form key=tenant "
                "(e.g. PLEXRL_API_KEYS='tml-abc=team-a,tml-def=team-b')"
            )
        tenant = tenant.strip()
        if not _TENANT.fullmatch(tenant) or tenant in (".", ".."):
            # Tenants name blob directories (ckpt/<tenant>/...) and Redis keys.
            raise ValueError(
                f"PLEXRL_API_KEYS tenant {tenant!r} is not allowed: use letters, digits and "
                "._@=+- only (not '.' or '..')"
            )
        keys[key.strip()] = tenant
    return keys


def parse_sentinels(spec: str) -> tuple[tuple[str, int], ...]:
    """`"host:port,host:port"` → ((host, port), ...); raises saying which entry is wrong."""
    out: list[tuple[str, int]] = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"PLEXRL_REDIS_SENTINELS entry {entry!r} is not host:port "
                "(e.g. PLEXRL_REDIS_SENTINELS='10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379')"
            )
        out.append((host.strip("[]"), int(port)))
    return tuple(out)
