"""An OpenAI request as Tinker `sample` calls, sent through the scheduler and awaited.

Each prompt becomes one `sample` call of the model's sampling job, checked by the same
rules (`translate.sample_input`) and published by the same submitter as an `asample`: it
is queued, placed, co-batched with other jobs' samples and accounted to the tenant like
any other. The request then waits on the call's future, as `retrieve_future` does.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from plexrl.messages import (
    CompletionStatus,
    ErrorCode,
    Function,
    MessageError,
    PhaseOutput,
    SampleOutput,
)
from plexrl.payloads import resolve
from plexrl_gateway.components import Gateway
from plexrl_gateway.errors import ApiError, Category
from plexrl_gateway.openai_errors import OpenAIError, invalid
from plexrl_gateway.openai_models import Target
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.schemas import ChunkBody, ModelInputBody, SampleBody, SamplingParamsBody
from plexrl_gateway.submitter import Call, Submission, ready
from plexrl_gateway.translate import sample_input

ANSWER_WITHIN_S = 600.0
"""How long a request waits for its calls (the OpenAI client's own default timeout)."""


@dataclass(frozen=True)
class Sampling:
    """What every prompt of one request is sampled with."""

    n: int
    max_tokens: int | None
    """None: as many as the prompt leaves room for (the model's and the call caps)."""
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]


def sampling(
    n: int,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
) -> Sampling:
    """OpenAI's parameters, checked with OpenAI's names and ranges."""
    if n < 1:
        raise invalid(f"n is {n}; it must be at least 1", "n")
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"max_tokens is {max_tokens}; it must be at least 1", "max_tokens")
    t = 1.0 if temperature is None else temperature
    if not (math.isfinite(t) and 0 <= t <= 2):
        raise invalid(f"temperature is {temperature}; it must be between 0 and 2", "temperature")
    p = 1.0 if top_p is None else top_p
    if not 0 < p <= 1:
        raise invalid(f"top_p is {top_p}; it must be in (0, 1]", "top_p")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise invalid("stop holds an empty string; remove it", "stop")
    return Sampling(n, max_tokens, t, p, seed, stops)


async def submit(
    gateway: Gateway, target: Target, tenant: str, prompts: list[list[int]], s: Sampling
) -> list[str]:
    """Publish one sample call per prompt, each checked first; their request ids."""
    limits = await gateway.catalog.limits(target.info.name)
    calls = []
    for tokens in prompts:
        body = SampleBody(
            num_samples=s.n,
            prompt=ModelInputBody(chunks=[ChunkBody(type="encoded_text", tokens=tokens)]),
            sampling_params=SamplingParamsBody(
                max_tokens=s.max_tokens,
                seed=s.seed,
                # OpenAI's absent or empty `stop` stops at the end of sequence only, which
                # is Tinker's absent `stop` (Tinker's `[]` would not stop even there).
                stop=list(s.stop) or None,
                temperature=s.temperature,
                top_p=s.top_p,
            ),
        )
        try:
            inp, work = sample_input(body, limits, target.weights_path, gateway.limits)
        except OpenAIError:
            raise
        except ApiError as exc:
            raise invalid(exc.message.replace("sampling_params.", "")) from None
        # A job of its own carries its spec, so the scheduler can admit it on first sight.
        spec = None if target.owner else target.job.spec
        calls.append(Call(Function.SAMPLE, inp, ResponseKind.SAMPLE, spec=spec, work=work))
    request_ids = []
    for call in calls:
        gateway.pending.admit(tenant)  # the tenant's pending-calls quota: 429 when over
        sub = Submission(target.job_id, tenant, sequenced=False)
        request_ids.append(await gateway.submitter.submit(sub, ready(call)))
    return request_ids


async def answers(gateway: Gateway, request_ids: list[str]) -> list[SampleOutput]:
    """Each call's output, once all are done; the first failure as an ApiError."""
    return list(await asyncio.gather(*(_answer(gateway, r) for r in request_ids)))


async def _answer(gateway: Gateway, request_id: str) -> SampleOutput:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ANSWER_WITHIN_S
    while (completion := await gateway.futures.wait(request_id, gateway.future_wait_s)) is None:
        if loop.time() >= deadline:
            raise OpenAIError(
                504,
                f"the sample call {request_id} did not finish within {ANSWER_WITHIN_S:.0f} s; "
                "the cluster may be busy, try again later",
                code="timeout",
            )
    if completion.status != CompletionStatus.OK:
        error = completion.error
        if error is None:
            raise ApiError(500, f"the sample call {request_id} failed without a reason")
        status = {ErrorCode.NOT_FOUND: 404, ErrorCode.UNAVAILABLE: 503}.get(
            error.code, 400 if error.user_error else 500
        )
        raise ApiError(status, error.message, Category.USER if status < 500 else Category.SERVER)
    try:
        output = await resolve(gateway.payloads, completion.result, PhaseOutput)
    except (KeyError, MessageError) as exc:
        raise ApiError(500, f"the result of {request_id} could not be read: {exc}") from None
    if not isinstance(output, SampleOutput):
        got = type(output).__name__ if output is not None else "nothing"
        raise ApiError(500, f"the worker answered a sample call with {got}")
    return output
