"""Batched generation over a Hugging Face causal LM with a KV cache, and its own decode loop.

Semantics (kept in one place, and what the tests pin):
- `logprobs` of a sampled token are log-softmax of the temperature-scaled logits, taken
  BEFORE top-k / top-p truncation; at temperature 0 (greedy) they are the plain (T=1)
  log-softmax. So at temperature 1 they equal the model's own logprobs of those tokens.
- Prompt logprobs are always at temperature 1; the first prompt token has none.
- A sequence stops on a stop token, an end-of-sequence token, or once its decoded text
  contains a stop string; the token that ended it is kept in the output.
- Draws come from one `torch.Generator` seeded per call, so the same seed, weights and
  input give the same tokens; rows that finish leave the batch and take no more draws.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plexrl import limits as rules
from plexrl.limits import DEFAULT_LIMITS, CallLimits, ModelLimits
from plexrl.messages import SampledSequence, SampleInput, SampleOutput, SamplingParams, StopReason
from plexrl_worker.engine.batch import engine_rules


@dataclass(frozen=True)
class StopRule:
    """When a sequence is finished."""

    token_ids: frozenset[int]
    """Stop tokens and the model's end-of-sequence tokens."""
    strings: tuple[str, ...]
    decode: Callable[[list[int]], str] | None
    """Token ids to text; needed only when there are stop strings."""

    def hit(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.token_ids:
            return True
        if self.strings and self.decode is not None:
            # Checking the whole text each step finds strings split across tokens; the
            # first hit ends the sequence, so any occurrence is a new one.
            text = self.decode(tokens)
            return any(s in text for s in self.strings)
        return False


def validate(inp: SampleInput, limits: ModelLimits, caps: CallLimits = DEFAULT_LIMITS) -> None:
    """Raise EngineInputError, saying what to change, for input the model cannot serve
    (plexrl.limits' rules: the gateway checked the same ones before publishing)."""
    p = inp.params
    with engine_rules():
        rules.check_sample_size(len(inp.prompt), inp.num_samples, p.max_tokens, limits, caps)
        rules.check_token_ids("prompt", inp.prompt, limits.vocab_size)
        rules.check_sampling_params(p.temperature, p.top_p, p.top_k, p.seed)
        rules.check_stop(p.stop_strings, p.stop_tokens, limits, caps)
        rules.check_topk_logprobs(inp.topk_prompt_logprobs, caps)


@torch.no_grad()
def generate(
    model: nn.Module,
    inp: SampleInput,
    stop: StopRule,
    *,
    device: torch.device,
    max_batch_tokens: int,
) -> SampleOutput:
    """Sample `inp.num_samples` continuations of `inp.prompt` (validated already)."""
    params = inp.params
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    prompt = torch.tensor([inp.prompt], dtype=torch.int64, device=device)
    want_prompt = inp.prompt_logprobs or inp.topk_prompt_logprobs > 0
    rows_per_pass = max(1, max_batch_tokens // (len(inp.prompt) + params.max_tokens))

    sequences: list[SampledSequence] = []
    prompt_lp: list[float | None] | None = None
    topk_lp: list[list[tuple[int, float]] | None] | None = None
    for start in range(0, inp.num_samples, rows_per_pass):
        rows = min(rows_per_pass, inp.num_samples - start)
        full = want_prompt and start == 0
        # Prefill one row and share its cache across the samples: every sample sees
        # the very same prompt state, and the prompt is run once.
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=0 if full else 1)
        logits = out.logits[0].float()
        if full:
            prompt_lp, topk_lp = _prompt_logprobs(logits, inp.prompt, inp)
        cache, cache_kw = kv_cache(out)
        cache.batch_repeat_interleave(rows)
        first = logits[-1].expand(rows, -1)
        sequences += _decode(model, cache, cache_kw, first, rows, params, stop, generator)
    return SampleOutput(
        sequences=sequences, prompt_logprobs=prompt_lp, topk_prompt_logprobs=topk_lp
    )


def kv_cache(out: Any) -> tuple[Any, str]:
    """The KV cache a forward pass returned, and the keyword that passes it back in:
    `cache` from transformers 5.2x on, `past_key_values` before (the engine runs on
    any 5.x; GPU images often hold an older one than this project's lock)."""
    cache = getattr(out, "cache", None)
    if cache is not None:
        return cache, "cache"
    return out.past_key_values, "past_key_values"


def _decode(
    model: nn.Module,
    cache: Any,
    cache_kw: str,
    logits: torch.Tensor,
    rows: int,
    params: SamplingParams,
    stop: StopRule,
    generator: torch.Generator,
) -> list[SampledSequence]:
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    reasons = [StopReason.LENGTH] * rows
    active = list(range(rows))
    for step in range(params.max_tokens):
        chosen, chosen_lp = pick(logits, params, generator)
        keep: list[int] = []
        for j, (row, t, lp) in enumerate(
            zip(active, chosen.tolist(), chosen_lp.tolist(), strict=True)
        ):
            tokens[row].append(t)
            logprobs[row].append(lp)
            if stop.hit(tokens[row]):
                reasons[row] = StopReason.STOP
            else:
                keep.append(j)
        if not keep or step == params.max_tokens - 1:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.int64, device=chosen.device)
            cache.batch_select_indices(index)
            chosen = chosen[index]
            active = [active[j] for j in keep]
        out = model(input_ids=chosen[:, None], use_cache=True, **{cache_kw: cache})
        logits = out.logits[:, -1].float()
    return [
        SampledSequence(tokens=t, logprobs=lp, stop_reason=r)
        for t, lp, r in zip(tokens, logprobs, reasons, strict=True)
    ]


def pick(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of [N, V] logits, and its logprob (see the module docstring)."""
    if params.temperature == 0:
        chosen = logits.argmax(dim=-1)
        logp = F.log_softmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature
        logp = F.log_softmax(scaled, dim=-1)
        probs = F.softmax(truncate(scaled, params.top_k, params.top_p), dim=-1)
        chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return chosen, logp.gather(-1, chosen[:, None]).squeeze(1)


def truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top-k, or outside the smallest set holding top_p of the
    probability mass, set to -inf (the most likely token always survives)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(ordered, dim=-1)
        # Mass strictly before each token; the first token's is 0, so it always stays.
        before = torch.cumsum(probs, dim=-1) - probs
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, ordered)
    return logits


def _prompt_logprobs(
    logits: torch.Tensor, prompt: Sequence[int], inp: SampleInput
) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    logp = F.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)
    plain: list[float | None] | None = None
    if inp.prompt_logprobs:
        plain = [None, *logp.gather(-1, targets[:, None]).squeeze(-1).tolist()]
    topk: list[list[tuple[int, float]] | None] | None = None
    if inp.topk_prompt_logprobs > 0:
        k = min(inp.topk_prompt_logprobs, logp.shape[-1])
        values, ids = logp.topk(k, dim=-1)
        topk = [None]
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True):
            topk.append(list(zip(row_ids, row_values, strict=True)))
    return plain, topk
