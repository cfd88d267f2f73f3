"""What one tenant may keep in Redis: its records of each kind and the bytes of their user
metadata. Every tenant's requests share one Redis and one gateway, so a tenant that
stored without bound (thousands of models, megabytes of `user_metadata` each) would make
every tenant's requests slower and the gateway's memory larger.

The gateway checks these where records are created (`plexrl_gateway.registry`); the
counts they are checked against are kept in Redis as records are written
(`plexrl.stores.tenant_records`), so a check costs the same however much a tenant holds,
and two gateways cannot both admit a tenant's last place. Each cap is an environment
setting of the gateway (`PLEXRL_QUOTA_*`, `plexrl.settings.GatewaySettings`); a refusal
is a 400 that names the quota, its value and the setting that raises it. It is a 400,
not a 429: waiting frees nothing (the Tinker SDK would retry a 429 for minutes), the
tenant must unload, delete or let sessions expire first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from plexrl.limits import InputError
from plexrl.stores.checkpoints import TTL_MAX_S, TTL_MIN_S
from plexrl.stores.tenant_records import Caps, Held, QuotaExceeded, RecordKind, metadata_bytes


class QuotaError(InputError):
    """A record would take its tenant past a quota; the message says which and what to do."""


@dataclass(frozen=True)
class RecordQuotas:
    """Per-tenant caps on records and metadata (the defaults leave room for long RL runs)."""

    sessions: int = 1024
    """Client sessions alive at once (PLEXRL_QUOTA_SESSIONS); one lives
    PLEXRL_RECORD_TTL_S after its last heartbeat, then frees its place."""
    training_models: int = 256
    """Training models loaded at once (PLEXRL_QUOTA_TRAINING_MODELS); unloading one
    (unload_model, or finishing its session) frees its place."""
    sampling_sessions: int = 10_000
    """Sampling sessions kept (PLEXRL_QUOTA_SAMPLING_SESSIONS); the ephemeral ones of
    save_weights_and_get_sampling_client free theirs when their snapshot is retired."""
    checkpoints: int = 10_000
    """Checkpoints kept (PLEXRL_QUOTA_CHECKPOINTS); deleting one frees its place."""
    record_metadata_bytes: int = 64 * 1024
    """Bytes of `user_metadata` (keys and values, UTF-8; a session's tags too) of one
    session or model (PLEXRL_QUOTA_RECORD_METADATA_BYTES)."""
    metadata_bytes: int = 16 * 1024**2
    """Bytes of `user_metadata` of all the tenant's records together, unloaded models'
    included while their records stay (PLEXRL_QUOTA_METADATA_BYTES)."""
    checkpoint_bytes: int = 1024**4
    """Bytes of checkpoints stored (PLEXRL_QUOTA_CHECKPOINT_BYTES): a save is refused
    once the tenant's checkpoints, ephemeral sampler snapshots included, hold this many;
    deleting one, or letting its TTL pass, frees its bytes. The save that crosses it is
    accepted (its size is known only once written)."""
    checkpoint_ttl_min_s: int = TTL_MIN_S
    """The shortest TTL a checkpoint may be given, seconds (PLEXRL_CHECKPOINT_TTL_MIN_S;
    the Tinker API's one hour); the longest is ten years."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"RecordQuotas.{f.name} is {value!r}; set {_setting(f.name)} to an integer >= 1"
                )

    def caps(self, kind: RecordKind) -> Caps:
        """What a new record of `kind` is checked against in Redis."""
        live = {
            RecordKind.SESSION: self.sessions,
            RecordKind.TRAINING: self.training_models,
            RecordKind.SAMPLING: self.sampling_sessions,
        }[kind]
        return Caps(live=live, metadata_bytes=self.metadata_bytes)

    def check_metadata(
        self, kind: RecordKind, metadata: dict[str, str], tags: list[str] | None = None
    ) -> None:
        """One record's user metadata against `record_metadata_bytes`."""
        size = metadata_bytes(metadata, tags)
        if size > self.record_metadata_bytes:
            raise QuotaError(
                f"the user_metadata of this {_NAMES[kind]} is {size} bytes, more than one "
                "record may hold (PLEXRL_QUOTA_RECORD_METADATA_BYTES="
                f"{self.record_metadata_bytes}); send less, or ask the operator to raise "
                "PLEXRL_QUOTA_RECORD_METADATA_BYTES"
            )

    def check_checkpoints(self, tenant: str, held: int) -> None:
        """A new checkpoint of a tenant that holds `held`."""
        if held >= self.checkpoints:
            raise QuotaError(
                f"tenant {tenant!r} holds {held} checkpoints, its quota "
                f"(PLEXRL_QUOTA_CHECKPOINTS={self.checkpoints}); delete some "
                "(RestClient.delete_checkpoint_from_tinker_path), save ephemeral sampler "
                "weights instead, or ask the operator to raise PLEXRL_QUOTA_CHECKPOINTS"
            )

    def check_ttl(self, ttl_s: int | None) -> None:
        """A TTL asked for a checkpoint (None: no expiry)."""
        if ttl_s is not None and not self.checkpoint_ttl_min_s <= ttl_s <= TTL_MAX_S:
            raise QuotaError(
                f"ttl_seconds is {ttl_s}; a checkpoint's TTL is between "
                f"{self.checkpoint_ttl_min_s} (PLEXRL_CHECKPOINT_TTL_MIN_S) and {TTL_MAX_S} "
                "seconds (ten years), or None to keep it until deleted"
            )

    def check_checkpoint_bytes(self, tenant: str, held: int) -> None:
        """A save of a tenant whose checkpoints hold `held` bytes."""
        if held >= self.checkpoint_bytes:
            raise QuotaError(
                f"tenant {tenant!r} stores {held} bytes of checkpoints, its quota "
                f"(PLEXRL_QUOTA_CHECKPOINT_BYTES={self.checkpoint_bytes}); delete checkpoints "
                "(RestClient.delete_checkpoint_from_tinker_path; list them with sizes with "
                "RestClient.list_user_checkpoints), set a TTL on those you need only for a "
                "while (set_checkpoint_ttl_from_tinker_path), or ask the operator to raise "
                "PLEXRL_QUOTA_CHECKPOINT_BYTES"
            )

    def refusal(self, tenant: str, exc: QuotaExceeded) -> QuotaError:
        """What to tell the tenant a write in Redis was refused for."""
        if exc.held == Held.METADATA:
            return QuotaError(
                f"tenant {tenant!r} holds {exc.count} bytes of user_metadata, and this "
                f"{_NAMES[exc.kind]}'s would pass its quota "
                f"(PLEXRL_QUOTA_METADATA_BYTES={self.metadata_bytes}); unload models or let "
                "sessions expire, send less, or ask the operator to raise "
                "PLEXRL_QUOTA_METADATA_BYTES"
            )
        setting, cap = _SETTINGS[exc.kind], self.caps(exc.kind).live
        return QuotaError(
            f"tenant {tenant!r} holds {exc.count} {_NAMES[exc.kind]}s, its quota "
            f"({setting}={cap}); {_FREE[exc.kind]}, or ask the operator to raise {setting}"
        )


DEFAULT_QUOTAS = RecordQuotas()


def _setting(field: str) -> str:
    """The environment setting of a RecordQuotas field."""
    if field == "checkpoint_ttl_min_s":
        return "PLEXRL_CHECKPOINT_TTL_MIN_S"
    return f"PLEXRL_QUOTA_{field.upper()}"


_NAMES = {
    RecordKind.SESSION: "session",
    RecordKind.TRAINING: "training model",
    RecordKind.SAMPLING: "sampling session",
}
_SETTINGS = {
    RecordKind.SESSION: "PLEXRL_QUOTA_SESSIONS",
    RecordKind.TRAINING: "PLEXRL_QUOTA_TRAINING_MODELS",
    RecordKind.SAMPLING: "PLEXRL_QUOTA_SAMPLING_SESSIONS",
}
_FREE = {
    RecordKind.SESSION: "reuse a ServiceClient or let idle sessions expire",
    RecordKind.TRAINING: "unload models you are done with (unload_model)",
    RecordKind.SAMPLING: (
        "reuse sampling clients, or use save_weights_and_get_sampling_client, whose "
        "sessions are retired with their snapshots"
    ),
}
