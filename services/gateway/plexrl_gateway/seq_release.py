"""A refused call never leaves a hole in its model's seq_id sequence.

The Tinker SDK numbers a training model's calls and sends each once the previous one
was answered, so the gateway publishes them in seq_id order and holds a call until the
lower ones are settled (plexrl_gateway.sequencer). A call the submitter refuses settles
its seq_id itself. One refused before it gets there does not: a route the gateway does
not serve (a method of a newer SDK), a request type it does not know, a body it cannot
read or that is too large, the pending-calls quota. Left unsettled, that seq_id would
make the client's next call wait out the gap timeout and fail, and every call after it.

`ReleaseRefused` is the ASGI middleware that settles those. It keeps the first bytes of
every POST body under `/api/v1/`, and when the answer is a refusal the client will not
send again (any 4xx or 5xx but a 503, which asks for the same call again) it reads the
model id and seq_id from them (a JSON body's members, or the first two fields of a
protobuf `ForwardBackwardRequest`), checks the caller's key owns that training model,
and uses the seq_id up before the answer leaves, so the next call runs at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plexrl.stores import JobKind
from plexrl_gateway.codec import PROTOBUF
from plexrl_gateway.components import Gateway
from plexrl_gateway.errors import ApiError

log = logging.getLogger(__name__)

KEPT_BYTES = 64 * 1024
"""How much of a body is kept: the SDK puts `model_id` and `seq_id` first in a
protobuf body, and a JSON body this size is read whole."""

PREFIX_READ_S = 2.0
"""Longest the middleware reads a body the app refused unread (a declared size over the
cap), to find its seq_id."""

RELEASE_WAIT_S = 2.0
"""Longest a refused call waits for its model's lower seq_ids before using up its own."""

_RETRIED = {502, 503, 504}
"""Answers that ask for the same call again: its seq_id is still to come."""

_MODEL_ID = re.compile(rb'"model_id"\s*:\s*"([^"\\]{1,256})"')
_SEQ_ID = re.compile(rb'"seq_id"\s*:\s*(\d{1,12})\b')


class ReleaseRefused:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self._app = app
        self._gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith("/api/v1/")
        ):
            await self._app(scope, receive, send)
            return
        kept = bytearray()
        ended = False

        async def keeping_receive() -> Message:
            nonlocal ended
            message = await receive()
            if message["type"] == "http.request":
                if len(kept) < KEPT_BYTES:
                    kept.extend(message.get("body", b"")[: KEPT_BYTES - len(kept)])
                ended = ended or not message.get("more_body", False)
            else:
                ended = True
            return message

        async def releasing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and _refused(message["status"]):
                if not kept and not ended:
                    await _read_prefix(receive, kept)
                await self._release(scope, bytes(kept))
            await send(message)

        await self._app(scope, keeping_receive, releasing_send)

    async def _release(self, scope: Scope, body: bytes) -> None:
        try:
            call = model_call(body, _header(scope, b"content-type") or "")
            if call is None:
                return
            model_id, seq_id = call
            tenant = self._gateway.keys.tenant(_header(scope, b"x-api-key"))
            job = await self._gateway.registry.find_job(tenant, model_id)
            if job is None or job.kind != JobKind.TRAINING:
                return
            if not await self._gateway.sequencer.release(job.job_id, seq_id, RELEASE_WAIT_S):
                log.info("refused %s seq_id %d: lower seq_ids still missing", model_id, seq_id)
        except ApiError:
            return  # no tenant: nobody's sequence to touch
        except Exception as exc:  # the refusal is answered all the same
            log.warning("could not use up the seq_id of a refused call: %r", exc)


def model_call(body: bytes, content_type: str) -> tuple[str, int] | None:
    """(model_id, seq_id) of a training call's body, protobuf (by its content type) or
    JSON, whole or its first bytes; None when it names no model or no seq_id."""
    if PROTOBUF in content_type:
        return _proto_call(body)
    return _json_call(body)


def _json_call(body: bytes) -> tuple[str, int] | None:
    try:
        doc: Any = json.loads(body)
    except ValueError:
        doc = None  # cut short or malformed: look for the members themselves
    if isinstance(doc, dict):
        model_id, seq_id = doc.get("model_id"), doc.get("seq_id")
        if isinstance(model_id, str) and type(seq_id) is int and seq_id >= 0:
            return model_id, seq_id
        return None
    models, seqs = _MODEL_ID.findall(body), _SEQ_ID.findall(body)
    if len(models) == 1 and len(seqs) == 1:
        return models[0].decode("utf-8", "replace"), int(seqs[0])
    return None


def _proto_call(body: bytes) -> tuple[str, int] | None:
    """Fields 1 (`model_id`, a string) and 2 (`seq_id`, a varint) of the top level."""
    model_id: str | None = None
    seq_id: int | None = None
    pos = 0
    while pos < len(body) and (model_id is None or seq_id is None):
        tag, pos = _varint(body, pos)
        if tag is None:
            return None
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(body, pos)
            if value is None:
                return None
            if field == 2:
                seq_id = value
        elif wire == 2:
            size, pos = _varint(body, pos)
            if size is None or pos + size > len(body):
                return None
            if field == 1:
                model_id = body[pos : pos + size].decode("utf-8", "replace")
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            return None
    if model_id and seq_id is not None:
        return model_id, seq_id
    return None


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None, pos


def _refused(status: int) -> bool:
    return status >= 400 and status not in _RETRIED


async def _read_prefix(receive: Receive, kept: bytearray) -> None:
    """Read up to KEPT_BYTES of a body nobody read, within PREFIX_READ_S."""
    try:
        async with asyncio.timeout(PREFIX_READ_S):
            while len(kept) < KEPT_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                kept.extend(message.get("body", b"")[: KEPT_BYTES - len(kept)])
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None
