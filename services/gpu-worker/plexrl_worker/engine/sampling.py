"""What `sample` means, kept in one place (the decode loop is `cobatch.Batcher`).

Semantics (what the tests pin):
- `logprobs` of a sampled token are log-softmax of the temperature-scaled logits, taken
  BEFORE top-k / top-p truncation; at temperature 0 (greedy) they are the plain (T=1)
  log-softmax. So at temperature 1 they equal the model's own logprobs of those tokens.
- Prompt logprobs are always at temperature 1; the first prompt token has none.
- A sequence stops on a stop token, an end-of-sequence token, or once its decoded text
  contains a stop string; the token that ended it is kept in the output.
- Each sample draws from its own `torch.Generator`, seeded from the call's seed and the
  sample's index (`cobatch.row_seed`): the same seed, weights and input give the same
  tokens, whatever else is sampled in the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plexrl import limits as rules
from plexrl.limits import DEFAULT_LIMITS, CallLimits, ModelLimits
from plexrl.messages import SampleInput, SamplingParams
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


def prompt_logprobs(
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
