"""Topic `plexrl.dlq`: a message that could not be parsed or handled, with the reason."""

from __future__ import annotations

import enum

import msgspec

from plexrl.messages.common import SCHEMA_VERSION


class DeadLetterReason(enum.StrEnum):
    """Why a message was set aside."""

    UNDECODABLE = "undecodable"
    """The bytes are not a valid message of the topic's type."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """The schema version is newer than this reader understands."""
    HANDLER_FAILED = "handler_failed"
    """The message decoded, but handling it raised."""


class DeadLetter(msgspec.Struct, frozen=True):
    source_topic: str
    partition: int
    offset: int
    key: bytes | None
    reason: DeadLetterReason
    detail: str
    value: bytes
    consumer: str
    at: float
    schema_version: int = SCHEMA_VERSION
