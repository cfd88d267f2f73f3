"""An OpenAI request as Tinker `sample` calls, sent through the scheduler and awaited.

Each prompt becomes one `sample` call of the model's sampling job, checked by the same
rules (`translate.sample_input`) and published by the same submitter as an `asample`: it
is queued, placed, co-batched with other jobs' samples and accounted to the tenant like
any other. The request then waits on the call's future, as `retrieve_future` does.

Alternatives (top-k logprobs) are not something the sampler returns for the tokens it
samples, so a request that asks for them makes a scoring pass afterwards: one more
`sample` call per choice over prompt + completion with `topk_prompt_logprobs`, as
Tinker's `compute_logprobs` is (one token sampled and thrown away), read at the choice's
positions. It goes through the scheduler like the first calls. `echo` without
alternatives needs no second pass: the sample call returns its prompt's logprobs.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plexrl import limits as rules
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
from plexrl_gateway.openai_text import Choice, Scores, choice
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.schemas import ChunkBody, ModelInputBody, SampleBody, SamplingParamsBody
from plexrl_gateway.submitter import Call, Submission, ready
from plexrl_gateway.translate import sample_input

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANSWER_WITHIN_S = 600.0
"""How long a request waits for its calls (the OpenAI client's own default timeout)."""


@dataclass(frozen=True)
class Sampling:
    """What every prompt of one request is sampled with."""

    n: int
    max_tokens: int | None
    """None: as many as the prompt leaves room for (the model's and the call caps);
    0 (with echo only): nothing is sampled, the prompt is scored."""
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]


@dataclass(frozen=True)
class Logprobs:
    """Which logprobs a request's choices show."""

    shown: bool
    """Any at all (completions' `logprobs` not null, chat's `logprobs: true`)."""
    top: int = 0
    """Alternatives per position (completions' `logprobs`, chat's `top_logprobs`)."""
    echo: bool = False
    """The prompt comes first (completions' `echo`), its first token without a logprob."""

    @property
    def scored(self) -> bool:
        """The scoring pass runs after sampling (max_tokens 0 always scores instead)."""
        return self.shown and self.top > 0


def sampling(
    n: int,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
    echo: bool = False,
) -> Sampling:
    """OpenAI's parameters, checked with OpenAI's names and ranges."""
    if n < 1:
        raise invalid(f"n is {n}; it must be at least 1", "n")
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        least = "0 (with echo)" if echo else "1 (0 only with echo, to score the prompt)"
        raise invalid(f"max_tokens is {max_tokens}; it must be at least {least}", "max_tokens")
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


@dataclass(frozen=True)
class Answer:
    """What a request's calls gave, in OpenAI's order (prompt by prompt, `n` each)."""

    choices: list[Choice]
    scores: list[Scores | None]
    """Each choice's logprobs; None when the request shows none."""
    outputs: list[SampleOutput]
    """The sample calls' outputs (none when max_tokens is 0): what `usage` counts."""


@dataclass(frozen=True)
class Calls:
    """One OpenAI request's calls: `submit` publishes the sample calls, checked first (so
    a bad request is a 400 before any stream starts); `answer` waits for them and makes
    the scoring pass its logprobs need."""

    gateway: Gateway
    target: Target
    tenant: str
    prompts: list[list[int]]
    sampling: Sampling
    logprobs: Logprobs

    @property
    def _only_scored(self) -> bool:
        return self.sampling.max_tokens == 0

    async def submit(self) -> list[str]:
        """The sample calls' request ids (max_tokens 0: the prompts' scoring calls)."""
        if self._only_scored:
            return await self._publish([self._score_body(p) for p in self.prompts])
        limits = await self.gateway.catalog.limits(self.target.info.name)
        return await self._publish([self._sample_body(p, limits) for p in self.prompts])

    async def answer(self, request_ids: list[str], tok: PreTrainedTokenizerBase) -> Answer:
        """The choices and their logprobs, once every call (scoring pass too) is done."""
        s, want = self.sampling, self.logprobs
        outputs = await answers(self.gateway, request_ids)
        if self._only_scored:
            # Nothing sampled: each prompt's n choices are its text alone and its scores.
            scores = [_read(out, p, 0) if want.shown else None for p, out in self._each(outputs)]
            empty = Choice("", "length", [], [])
            return Answer([empty] * len(scores) * s.n, [x for x in scores for _ in range(s.n)], [])
        sampled = [
            (p, out, choice(tok, seq, s.stop))
            for p, out in self._each(outputs)
            for seq in out.sequences
        ]
        choices = [c for _, _, c in sampled]
        if not want.shown:
            return Answer(choices, [None] * len(choices), outputs)
        if not want.scored:
            return Answer(choices, [self._sampled_scores(*x) for x in sampled], outputs)
        return Answer(choices, await self._scoring_pass([(p, c) for p, _, c in sampled]), outputs)

    def _each(self, outputs: list[SampleOutput]) -> list[tuple[list[int], SampleOutput]]:
        return list(zip(self.prompts, outputs, strict=True))

    def _sampled_scores(self, prompt: list[int], out: SampleOutput, c: Choice) -> Scores | None:
        """The sampler's own logprobs (after the prompt's, which its call returned)."""
        if not self.logprobs.echo:
            return Scores(c.tokens, list(c.logprobs), None)
        return Scores([*prompt, *c.tokens], [*_read(out, prompt, 0).logprobs, *c.logprobs], None)

    async def _scoring_pass(self, sampled: list[tuple[list[int], Choice]]) -> list[Scores | None]:
        """One call per choice over its prompt + completion, read from where it shows
        logprobs (the prompt's start with echo, else the completion's)."""
        echo = self.logprobs.echo
        todo = [i for i, (_, c) in enumerate(sampled) if echo or c.tokens]
        seqs = {i: [*sampled[i][0], *sampled[i][1].tokens] for i in todo}
        ids = await self._publish([self._score_body(seqs[i]) for i in todo])
        outs = dict(zip(todo, await answers(self.gateway, ids), strict=True))
        scores: list[Scores | None] = []
        for i, (prompt, _) in enumerate(sampled):
            start = 0 if echo else len(prompt)
            scores.append(_read(outs[i], seqs[i], start) if i in outs else Scores([], [], []))
        return scores

    def _sample_body(self, tokens: list[int], limits: rules.ModelLimits) -> SampleBody:
        s, want = self.sampling, self.logprobs
        max_tokens = s.max_tokens
        if want.scored:
            # The scoring pass samples one token after prompt + completion: keep it room.
            room = limits.max_positions - len(tokens) - 1
            if max_tokens is None and room >= 1:
                caps = self.gateway.limits
                max_tokens = min(room, rules.default_max_tokens(len(tokens) + 1, s.n, limits, caps))
            elif max_tokens is None or max_tokens > room:
                raise invalid(
                    f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens or 1}) leaves no "
                    f"position of the model's {limits.max_positions} for the scoring pass "
                    "that logprobs alternatives need; "
                    + (
                        f"lower max_tokens to at most {room}" if room >= 1 else "shorten the prompt"
                    ),
                    "max_tokens",
                )
        return SampleBody(
            num_samples=s.n,
            prompt=ModelInputBody(chunks=[ChunkBody(type="encoded_text", tokens=tokens)]),
            sampling_params=SamplingParamsBody(
                max_tokens=max_tokens,
                seed=s.seed,
                # OpenAI's absent or empty `stop` stops at the end of sequence only, which
                # is Tinker's absent `stop` (Tinker's `[]` would not stop even there).
                stop=list(s.stop) or None,
                temperature=s.temperature,
                top_p=s.top_p,
            ),
            # Echo without alternatives: the prompt's logprobs come with the sample.
            prompt_logprobs=want.shown and want.echo and not want.scored,
        )

    def _score_body(self, tokens: list[int]) -> SampleBody:
        """Tinker's `compute_logprobs`, with alternatives: one greedy token is sampled
        (and dropped) after the scored tokens."""
        return SampleBody(
            num_samples=1,
            prompt=ModelInputBody(chunks=[ChunkBody(type="encoded_text", tokens=tokens)]),
            sampling_params=SamplingParamsBody(max_tokens=1, temperature=0.0),
            prompt_logprobs=True,
            topk_prompt_logprobs=self.logprobs.top,
        )

    async def _publish(self, bodies: list[SampleBody]) -> list[str]:
        """Publish one sample call per body, each checked first; their request ids."""
        gateway, target = self.gateway, self.target
        limits = await gateway.catalog.limits(target.info.name)
        calls = []
        for body in bodies:
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
            gateway.pending.admit(self.tenant)  # the pending-calls quota: 429 when over
            sub = Submission(target.job_id, self.tenant, sequenced=False)
            request_ids.append(await gateway.submitter.submit(sub, ready(call)))
        return request_ids


def _read(out: SampleOutput, tokens: list[int], start: int) -> Scores:
    """The prompt logprobs of a call over `tokens`, from position `start` on."""
    if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(tokens):
        raise ApiError(500, "a sample call answered without the prompt logprobs it asked for")
    top = out.topk_prompt_logprobs
    return Scores(
        tokens[start:],
        out.prompt_logprobs[start:],
        None if top is None else [None if t is None else list(t) for t in top[start:]],
    )


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
