"""Continuous batching for `sample`: the sequences of many calls, of many jobs over one
base model, decode together, one forward pass per model per step; calls join and
leave the running batch between steps.

What a sequence computes never depends on what else is in the batch, to the bit:
- it keeps its own KV cache and position, and attends over them alone (`_attend`);
- every matrix product runs row by row (`rowwise_linear`): a CPU GEMM rounds a row
  differently with the batch's size and the row's place in it (measured on torch 2.15:
  rows differ between batches of 1, 2–3 and 4+ rows, and at some places in batches of
  5–11), while a batched product of single rows runs the same kernel for every row;
- LoRA jobs share the base's products and add their own adapter's (peft's mixed-batch
  forward), each over its own rows;
- it draws from its own generator, seeded from the call's seed and its index.
So a job's samples are the same sampled alone or beside any number of other jobs.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import LoraLayer
from torch import nn
from transformers import AttentionInterface

from plexrl.messages import SampledSequence, SampleInput, SampleOutput, StopReason
from plexrl_worker.engine import sampling

ATTENTION = "plexrl_rows"
"""The attention implementation a batch step runs under (registered below)."""

BASE_ADAPTER = "__base__"
"""peft's name for "no adapter" in a mixed batch."""


def rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` as a batch of one-row products, so each row's result is independent of
    the others (see the module docstring). Slower than one GEMM for wide layers; the
    price of bit-identical samples whatever shares the batch."""
    rows = x.reshape(-1, 1, x.shape[-1])
    out = torch.bmm(rows, weight.t().expand(rows.shape[0], -1, -1))
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rowwise_linear(x, self.weight, self.bias)


@dataclass
class _Row:
    """One sequence being generated."""

    call: SampleCall
    index: int
    generator: torch.Generator
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer, [1, kv_heads, prompt + max_tokens, head_dim] buffers."""
    length: int
    """Tokens in the cache."""
    logits: torch.Tensor
    """[vocab] logits of the next token."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: StopReason = StopReason.LENGTH
    done: bool = False


@dataclass(eq=False)
class SampleCall:
    """One `sample` call in the batcher: its input, where it runs, and its sequences."""

    weights_id: str
    model: nn.Module
    adapter: str
    """The LoRA slot its rows use, or BASE_ADAPTER."""
    inp: SampleInput
    stop: sampling.StopRule
    seed: int
    first_index: int = 0
    """The call's index of its first sample here: a call split over several batchers
    (a worker group's ranks) draws sample i from `row_seed(seed, i)` wherever it runs."""
    rows: list[_Row] = field(default_factory=list)
    """The admitted samples, by index (the rest wait for room in the batch)."""
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    abandoned: str | None = None
    """Why the call left the batch unfinished (its weights went away), if it did."""

    @property
    def tokens_per_row(self) -> int:
        return len(self.inp.prompt) + self.inp.params.max_tokens

    @property
    def done(self) -> bool:
        return self.abandoned is not None or (
            len(self.rows) == self.inp.num_samples and all(r.done for r in self.rows)
        )

    @property
    def remaining(self) -> int:
        """Sequences not finished yet (admitted or waiting)."""
        if self.abandoned is not None:
            return 0
        return self.inp.num_samples - sum(1 for r in self.rows if r.done)

    def output(self) -> SampleOutput:
        return SampleOutput(
            sequences=[
                SampledSequence(tokens=r.tokens, logprobs=r.logprobs, stop_reason=r.reason)
                for r in self.rows
            ],
            prompt_logprobs=self.prompt_logprobs,
            topk_prompt_logprobs=self.topk_prompt_logprobs,
        )


class Batcher:
    """The running batch. Not thread-safe: the engine calls it under its lock."""

    def __init__(self, *, device: torch.device, max_batch_tokens: int) -> None:
        self._device = device
        self._max_batch_tokens = max_batch_tokens
        self._calls: list[SampleCall] = []

    @property
    def calls(self) -> list[SampleCall]:
        return list(self._calls)

    @torch.no_grad()
    def join(
        self,
        weights_id: str,
        model: nn.Module,
        adapter: str,
        inp: SampleInput,
        stop: sampling.StopRule,
        first_index: int = 0,
    ) -> SampleCall:
        """Add a (validated) call: its prompt is run now, its rows join at the next step.
        `inp.num_samples` of them, numbered from `first_index` for their seeds."""
        params = inp.params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        call = SampleCall(
            weights_id=weights_id,
            model=model,
            adapter=adapter,
            inp=inp,
            stop=stop,
            seed=seed,
            first_index=first_index,
        )
        self._prefill(call)
        self._calls.append(call)
        return call

    @torch.no_grad()
    def step(self) -> list[SampleCall]:
        """Admit waiting rows, pick one token for every running row, and run the rows
        still going one position on; the calls this finished, now out of the batch."""
        self._admit()
        running = [r for c in self._calls for r in c.rows if not r.done]
        going: list[_Row] = []
        for row in running:
            params = row.call.inp.params
            chosen, lp = sampling.pick(row.logits[None], params, row.generator)
            row.tokens.append(int(chosen[0]))
            row.logprobs.append(float(lp[0]))
            if row.call.stop.hit(row.tokens):
                row.reason, row.done = StopReason.STOP, True
            elif len(row.tokens) >= params.max_tokens:
                row.done = True
            else:
                going.append(row)
        by_model: dict[int, list[_Row]] = {}
        for row in going:
            by_model.setdefault(id(row.call.model), []).append(row)
        for rows in by_model.values():
            self._forward(rows)
        finished = [c for c in self._calls if c.done]
        self._calls = [c for c in self._calls if not c.done]
        return finished

    def run(self, calls: Sequence[SampleCall]) -> None:
        """Step until every call in `calls` is done (others in the batch advance too)."""
        while not all(c.done for c in calls):
            self.step()

    def abandon(self, weights_id: str, reason: str) -> list[SampleCall]:
        """Take the calls sampling `weights_id` out of the batch, unfinished (its weights
        are going away); they answer `reason`."""
        gone = [c for c in self._calls if c.weights_id == weights_id]
        for call in gone:
            call.abandoned = reason
        self._calls = [c for c in self._calls if c.abandoned is None]
        return gone

    # ---- internals ---------------------------------------------------------------------

    def _prefill(self, call: SampleCall) -> None:
        inp = call.inp
        want_prompt = inp.prompt_logprobs or inp.topk_prompt_logprobs > 0
        kv = [_empty_kv(call.model, len(inp.prompt), self._device)]
        ids = torch.tensor([inp.prompt], dtype=torch.int64, device=self._device)
        logits = self._run(
            call.model,
            ids,
            _positions([0], len(inp.prompt), self._device),
            [call.adapter],
            kv,
            [0],
            keep_all=want_prompt,
        )[0]
        if want_prompt:
            call.prompt_logprobs, call.topk_prompt_logprobs = sampling.prompt_logprobs(
                logits, inp.prompt, inp
            )
        call.prompt_kv = kv[0]
        call.first_logits = logits[-1]

    def _admit(self) -> None:
        """Give waiting rows a place while the batch's tokens fit (always at least one)."""
        used = sum(c.tokens_per_row for c in self._calls for r in c.rows if not r.done)
        for call in self._calls:
            while len(call.rows) < call.inp.num_samples:
                if used > 0 and used + call.tokens_per_row > self._max_batch_tokens:
                    return
                call.rows.append(self._new_row(call, len(call.rows)))
                used += call.tokens_per_row

    def _new_row(self, call: SampleCall, index: int) -> _Row:
        assert call.first_logits is not None
        prompt_len = len(call.inp.prompt)
        kv = _empty_kv(call.model, call.tokens_per_row, self._device)
        for (k, v), (pk, pv) in zip(kv, call.prompt_kv, strict=True):
            k[:, :, :prompt_len] = pk
            v[:, :, :prompt_len] = pv
        generator = torch.Generator(device=self._device)
        generator.manual_seed(row_seed(call.seed, call.first_index + index))
        return _Row(call, index, generator, kv, prompt_len, call.first_logits)

    def _forward(self, rows: list[_Row]) -> None:
        ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.int64, device=self._device)
        lengths = [r.length for r in rows]
        logits = self._run(
            rows[0].call.model,
            ids,
            _positions(lengths, 1, self._device),
            [r.call.adapter for r in rows],
            [r.kv for r in rows],
            lengths,
            keep_all=False,
        )
        for row, row_logits in zip(rows, logits, strict=True):
            row.length += 1
            row.logits = row_logits[-1]

    def _run(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        positions: torch.Tensor,
        adapters: list[str],
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]],
        lengths: list[int],
        *,
        keep_all: bool,
    ) -> torch.Tensor:
        """Logits [rows, positions kept, vocab] (float32) of one forward pass."""
        with _rows_attention(model), _batch_pass(model, adapters):
            out = model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=0 if keep_all else 1,
                plexrl_rows=_RowsContext(kv, lengths),
            )
        return out.logits.float()


def row_seed(seed: int, index: int) -> int:
    """Sample `index`'s generator seed: a 63-bit mix (splitmix64) of the call's seed and
    the index, so rows of one call draw independent streams."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class _RowsContext:
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    """Per row, per layer (keys, values) buffers."""
    lengths: list[int]
    """Per row, tokens already in its buffers; this pass's keys go right after them."""


def _attend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    plexrl_rows: _RowsContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a batch of unrelated rows: each row stores this pass's keys and
    values in its own buffers and attends over its own history only (causal within the
    pass). query/key/value: [rows, heads, new tokens, head_dim]."""
    if plexrl_rows is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside a Batcher pass")
    layer: int = getattr(module, "layer_idx")  # noqa: B009 - set on every HF attention
    new = query.shape[2]
    outputs = []
    for i, start in enumerate(plexrl_rows.lengths):
        keys, values = plexrl_rows.kv[i][layer]
        keys[:, :, start : start + new] = key[i : i + 1]
        values[:, :, start : start + new] = value[i : i + 1]
        outputs.append(
            F.scaled_dot_product_attention(
                query[i : i + 1],
                keys[:, :, : start + new],
                values[:, :, : start + new],
                is_causal=new > 1,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _attend)


def _positions(lengths: list[int], new: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [list(range(n, n + new)) for n in lengths], dtype=torch.int64, device=device
    )


def _empty_kv(
    model: nn.Module, tokens: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config: Any = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    shape = (1, heads, tokens, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


@contextmanager
def _rows_attention(model: nn.Module) -> Iterator[None]:
    config: Any = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


@contextmanager
def _batch_pass(model: nn.Module, adapters: list[str]) -> Iterator[None]:
    """For the duration: every `nn.Linear` of `model` outside the adapters (base layers,
    the head) multiplies row by row (`rowwise_linear`), and every LoRA layer adds to each
    row its own adapter's product, row by row too (`_mixed_lora_forward`, peft's
    mixed-batch forward with the rows of each adapter found once per pass, not once per
    layer). Set on the
    modules themselves, not as a torch function mode: a mode would add a Python call to
    every op of the pass (measured 40% of a decode step)."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(adapters):
        groups.setdefault(name, []).append(i)
    device = next(model.parameters()).device
    rows = [
        (name, torch.tensor(index, dtype=torch.int64, device=device))
        for name, index in groups.items()
        if name != BASE_ADAPTER
    ]
    loras, linears = _pass_modules(model)
    for layer in loras:
        layer.forward = functools.partial(_mixed_lora_forward, layer, rows)
    for linear in linears:
        linear.forward = _rowwise_forward.__get__(linear)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in [*loras, *linears]:
            del module.forward


def _pass_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Linear]]:
    """The LoRA layers of `model` and the `nn.Linear`s a pass runs outside them (the
    LoRA layers' base layers among them). An adapter's own A and B are left out: a
    worker holds up to `max_samplers` adapters on one base, and walking (and patching)
    every one of them on every decode step cost more than the step (2.7x slower sampling
    with 64 installed, measured); `_mixed_lora_forward` multiplies the batch's own
    adapters row by row itself."""
    loras: list[nn.Module] = []
    linears: list[nn.Linear] = []
    stack = [model]
    while stack:
        module = stack.pop()
        if isinstance(module, LoraLayer):
            loras.append(module)
            stack.append(module.get_base_layer())
        elif isinstance(module, nn.Linear):
            linears.append(module)
        else:
            stack.extend(module.children())
    return loras, linears


def _mixed_lora_forward(
    layer: Any, rows: list[tuple[str, torch.Tensor]], x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """A peft LoRA linear layer over a batch whose rows use different adapters: the base
    layer's product for all rows, plus each adapter's `B(A(x)) * scaling` on its rows
    (peft's `_mixed_batch_forward` for plain LoRA, with the row indices given)."""
    result: torch.Tensor = layer.base_layer(x, *args, **kwargs)
    for name, index in rows:
        if name not in layer.lora_A:
            continue
        a, b = layer.lora_A[name], layer.lora_B[name]
        sub = layer.lora_dropout[name](x[index])
        delta = rowwise_linear(rowwise_linear(sub, a.weight, a.bias), b.weight, b.bias)
        result[index] += delta * layer.scaling[name]
    return result
