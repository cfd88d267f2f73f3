"""Payloads over the inline threshold go by reference: stored once, the message carries a key."""

from __future__ import annotations

from typing import Any, TypeVar

from plexrl.messages import PayloadRef, decode, encode
from plexrl.stores import PayloadStore

T = TypeVar("T")


async def inline_or_ref(
    payloads: PayloadStore, payload: T, inline_max_bytes: int
) -> T | PayloadRef:
    """The payload itself when small, else a reference to its stored encoding."""
    data = encode(payload)
    if len(data) <= inline_max_bytes:
        return payload
    return await payloads.put_payload(data)


async def resolve(payloads: PayloadStore, payload: Any, type_: Any) -> Any:
    """The payload, fetching and decoding it when it is a reference."""
    if isinstance(payload, PayloadRef):
        return decode(await payloads.get_payload(payload), type_)
    return payload
