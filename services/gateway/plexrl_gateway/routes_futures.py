"""Tinker API: futures. `retrieve_future` long-polls and answers the moment a result exists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from plexrl import tracing
from plexrl.messages import MessageError, PhaseOutput
from plexrl.payloads import resolve
from plexrl_gateway import metrics
from plexrl_gateway.codec import PROTOBUF
from plexrl_gateway.deps import Calls, Futures, GatewayDep, Payloads, Tenant
from plexrl_gateway.errors import Category, error_body, not_found
from plexrl_gateway.render import render, try_again
from plexrl_gateway.schemas import FutureBody

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future")
async def retrieve_future(
    request: Request,
    body: FutureBody,
    tenant: Tenant,
    calls: Calls,
    payloads: Payloads,
    futures: Futures,
    gateway: GatewayDep,
) -> Response:
    # A call this gateway accepted is known without a read (`plexrl_gateway.accepted`).
    future = futures.accepted.future(body.request_id) or await calls.get_future(body.request_id)
    if future is None or future.tenant != tenant:
        raise not_found(f"unknown future {body.request_id!r}")
    # Polls are traces of their own (one per HTTP request); the link leads to the call.
    tracing.link_to(future.traceparent, **{"plexrl.request_id": future.request_id})
    completion = await futures.wait(future.request_id, gateway.future_wait_s)
    if completion is None:
        metrics.TRY_AGAIN.inc()
        return try_again(future.request_id)
    metrics.RESULTS_DELIVERED.labels(future.response_kind, str(completion.status)).inc()
    try:
        output = await resolve(payloads, completion.result, PhaseOutput)
    except (KeyError, MessageError) as exc:
        message = f"the result of {future.request_id} could not be read: {exc}"
        return JSONResponse(error_body(message, Category.SERVER))
    return render(future, completion, output, protobuf=accepts_protobuf(request.headers))


def accepts_protobuf(headers: Mapping[str, str]) -> bool:
    """SDKs since 0.19 poll forward and sample results with `Accept: application/x-protobuf`;
    older ones send only `Accept: application/json` and read JSON. Without either (no
    header, `*/*`) the answer is protobuf, as the newest SDK reads it."""
    accept = headers.get("accept", "")
    return PROTOBUF in accept or "application/json" not in accept


@router.post("/cancel_future")
async def cancel_future(_: Tenant) -> dict[str, Any]:
    # Accepted and ignored: a call that was queued runs to the end (sample cancel is off).
    return {}
