"""OpenAI-compatible inference on served base models and sampler checkpoints.

`/oai/api/v1/completions`, `/chat/completions` (both may stream) and `/models`, with the
tenant's API key as the bearer token. Every request becomes Tinker `sample` calls that go
through the scheduler (plexrl_gateway.openai_calls), with a scoring pass after them when
it asks for alternatives (top-k logprobs); the sampler answers a call whole, so a stream
carries each choice's text in one chunk once its calls are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse

from plexrl_gateway.deps import GatewayDep
from plexrl_gateway.errors import ApiError
from plexrl_gateway.openai_calls import Answer, Calls, Logprobs, sampling
from plexrl_gateway.openai_errors import OpenAIError, OpenAIRoute, error_body
from plexrl_gateway.openai_models import resolve
from plexrl_gateway.openai_schemas import ChatBody, CompletionBody, refused
from plexrl_gateway.openai_text import (
    Tokenizers,
    chat_logprobs,
    chat_prompt,
    completion_logprobs,
    echoed,
    prompts,
)
from plexrl_gateway.translate import CheckpointKind

router = APIRouter(prefix="/oai/api/v1", route_class=OpenAIRoute)

_tokenizers = Tokenizers()
"""Keyed by model directory, which does not change under a running gateway."""

KEEPALIVE_S = 10.0
"""A stream sends an SSE comment this often while its calls run, so proxies keep it open."""


async def _tenant(
    gateway: GatewayDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise OpenAIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>' with the tenant's API key "
            "(the OpenAI client's api_key)",
        )
    try:
        return gateway.keys.tenant(key.strip())
    except ApiError:
        raise OpenAIError(401, "unknown API key; send the API key you were given") from None


Tenant = Annotated[str, Depends(_tenant)]


def _usage(prompt_lists: list[list[int]], answer: Answer) -> dict[str, int]:
    """The scoring pass is not counted: it is the server's way to the logprobs asked for."""
    prompt = sum(len(p) for p in prompt_lists)
    completion = sum(len(seq.tokens) for out in answer.outputs for seq in out.sequences)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


async def _stream(
    wait: asyncio.Task[Answer],
    first: list[dict[str, Any]],
    chunks: Callable[[Answer], list[dict[str, Any]]],
) -> AsyncIterator[bytes]:
    """`first` at once; then, when the calls are done, `chunks` of their outputs and
    `[DONE]`. A call that fails ends the stream with an OpenAI error event."""
    try:
        for chunk in first:
            yield _sse(chunk)
        while True:
            done, _ = await asyncio.wait({wait}, timeout=KEEPALIVE_S)
            if done:
                break
            yield b": keep-alive\n\n"
        try:
            answer = wait.result()
        except ApiError as exc:
            yield _sse(error_body(exc))
            return
        for chunk in chunks(answer):
            yield _sse(chunk)
        yield _sse("[DONE]")
    finally:
        if not wait.done():  # the client went away; the calls themselves run to the end
            wait.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await wait


def _header(kind: str, prefix: str, model: str) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionBody, tenant: Tenant, gateway: GatewayDep
) -> dict[str, Any] | StreamingResponse:
    refused(body, chat=False)
    s = sampling(
        body.n, body.max_tokens, body.temperature, body.top_p, body.seed, body.stop, body.echo
    )
    want = Logprobs(body.logprobs is not None, body.logprobs or 0, body.echo)
    target = await resolve(body.model, tenant, gateway.registry, gateway.catalog)
    tok = await _tokenizers.get(target.info)
    prompt_lists = prompts(tok, body.prompt)
    echo = echoed(tok, body.prompt, prompt_lists) if body.echo else [""] * len(prompt_lists)
    calls = Calls(gateway, target, tenant, prompt_lists, s, want)
    request_ids = await calls.submit()
    head = _header("text_completion", "cmpl", body.model)

    def rendered(answer: Answer) -> list[dict[str, Any]]:
        return [
            {
                "index": i,
                "text": echo[i // s.n] + c.text,
                "logprobs": None if lp is None else completion_logprobs(tok, lp),
                "finish_reason": c.finish_reason,
            }
            for i, (c, lp) in enumerate(zip(answer.choices, answer.scores, strict=True))
        ]

    if not body.stream:
        answer = await calls.answer(request_ids, tok)
        return {**head, "choices": rendered(answer), "usage": _usage(prompt_lists, answer)}

    def chunks(answer: Answer) -> list[dict[str, Any]]:
        out = [{**head, "choices": [c]} for c in rendered(answer)]
        if body.stream_options and body.stream_options.include_usage:
            out.append({**head, "choices": [], "usage": _usage(prompt_lists, answer)})
        return out

    wait = asyncio.create_task(calls.answer(request_ids, tok))
    return StreamingResponse(_stream(wait, [], chunks), media_type="text/event-stream")


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatBody, tenant: Tenant, gateway: GatewayDep
) -> dict[str, Any] | StreamingResponse:
    refused(body, chat=True)
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise OpenAIError(
            400,
            "max_tokens and max_completion_tokens differ; send one of them",
            param="max_tokens",
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    s = sampling(body.n, max_tokens, body.temperature, body.top_p, body.seed, body.stop)
    want = Logprobs(body.logprobs, body.top_logprobs or 0)
    target = await resolve(body.model, tenant, gateway.registry, gateway.catalog)
    tok = await _tokenizers.get(target.info)
    prompt_lists = [chat_prompt(tok, body.model, body.messages)]
    calls = Calls(gateway, target, tenant, prompt_lists, s, want)
    request_ids = await calls.submit()
    head = _header("chat.completion", "chatcmpl", body.model)

    if not body.stream:
        answer = await calls.answer(request_ids, tok)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": None if lp is None else chat_logprobs(tok, lp),
                "finish_reason": c.finish_reason,
            }
            for i, (c, lp) in enumerate(zip(answer.choices, answer.scores, strict=True))
        ]
        return {**head, "choices": choices, "usage": _usage(prompt_lists, answer)}

    chunk_head = {**head, "object": "chat.completion.chunk"}
    first = [
        {
            **chunk_head,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(s.n)
            ],
        }
    ]

    def chunks(answer: Answer) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, (c, lp) in enumerate(zip(answer.choices, answer.scores, strict=True)):
            logprobs = None if lp is None else chat_logprobs(tok, lp)
            delta = {"index": i, "delta": {"content": c.text}, "logprobs": logprobs}
            out.append({**chunk_head, "choices": [{**delta, "finish_reason": None}]})
            end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}
            out.append({**chunk_head, "choices": [end]})
        if body.stream_options and body.stream_options.include_usage:
            out.append({**chunk_head, "choices": [], "usage": _usage(prompt_lists, answer)})
        return out

    wait = asyncio.create_task(calls.answer(request_ids, tok))
    return StreamingResponse(_stream(wait, first, chunks), media_type="text/event-stream")


def _model(name: str, owner: str, created: int = 0) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": owner}


@router.get("/models")
async def list_models(tenant: Tenant, gateway: GatewayDep) -> dict[str, Any]:
    """The served base models (aliases too), then the tenant's runnable checkpoints."""
    data = [_model(name, "plexrl") for name in await gateway.catalog.names()]
    runnable = {str(CheckpointKind.SAMPLER_WEIGHTS), str(CheckpointKind.WEIGHTS)}
    for ckpt in await gateway.registry.checkpoints(tenant):
        if ckpt.kind in runnable:
            data.append(_model(ckpt.path, tenant, int(ckpt.created_at)))
    return {"object": "list", "data": data}


@router.get("/models/{model:path}")
async def retrieve_model(model: str, tenant: Tenant, gateway: GatewayDep) -> dict[str, Any]:
    target = await resolve(model, tenant, gateway.registry, gateway.catalog, make_job=False)
    owner = "plexrl" if target.weights_path is None else tenant
    return _model(model, owner)
