"""Validate a forward_backward call's data and pack it into padded micro-batches.

The input rules are plexrl.limits' (the gateway checks the same ones first); only what
needs the tensors themselves (dtypes, byte counts, finiteness) is checked here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plexrl import limits as rules
from plexrl.limits import DEFAULT_LIMITS, CallLimits, InputError, ModelLimits
from plexrl.messages import Datum, LossFn, TensorArray
from plexrl_worker.engine.arrays import to_array, to_tensor
from plexrl_worker.engine.errors import EngineInputError
from plexrl_worker.engine.losses import LOSS_INPUTS, elementwise_loss, loss_config

__all__ = ["MicroBatch", "ModelLimits", "engine_rules", "prepare"]


@contextlib.contextmanager
def engine_rules() -> Iterator[None]:
    """plexrl.limits' InputError as the engine's EngineInputError (a BAD_REQUEST result)."""
    try:
        yield
    except InputError as exc:
        raise EngineInputError(str(exc)) from None


@dataclass
class MicroBatch:
    """Consecutive data, right-padded to one length (causal attention never looks right,
    so padding changes nothing for the real tokens and needs no attention mask)."""

    first: int
    """Index in the call's data of the first datum here."""
    lengths: list[int]
    tokens: torch.Tensor
    """[B, T] int64 input ids, padded with 0."""
    mask: torch.Tensor
    """[B, T] bool, True on real tokens."""
    inputs: dict[str, torch.Tensor]
    """Per-token loss inputs, [B, T] each (`target_tokens` int64, the rest float32)."""


@dataclass(frozen=True)
class _Checked:
    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]


def prepare(
    data: list[Datum],
    loss_fn: LossFn,
    limits: ModelLimits,
    max_batch_tokens: int,
    caps: CallLimits = DEFAULT_LIMITS,
) -> list[MicroBatch]:
    """Check every datum (raising EngineInputError naming the datum and the fix), then pack."""
    with engine_rules():
        rules.check_call_size((len(d.tokens) for d in data), caps)
        checked = [_check(i, d, loss_fn, limits) for i, d in enumerate(data)]
    batches: list[MicroBatch] = []
    start = 0
    while start < len(checked):
        end, longest = start + 1, len(checked[start].tokens)
        # Greedy: grow while the padded batch (rows x longest row) stays within budget.
        while end < len(checked):
            grown = max(longest, len(checked[end].tokens))
            if grown * (end - start + 1) > max_batch_tokens:
                break
            end, longest = end + 1, grown
        batches.append(_pad(start, checked[start:end]))
        start = end
    return batches


def _check(i: int, datum: Datum, loss_fn: LossFn, limits: ModelLimits) -> _Checked:
    n = len(datum.tokens)
    rules.check_datum_length(i, n, limits)
    rules.check_token_ids(f"data[{i}].tokens", datum.tokens, limits.vocab_size)
    tokens = torch.tensor(datum.tokens, dtype=torch.int64)

    spec = LOSS_INPUTS[loss_fn]
    given = datum.loss_fn_inputs
    rules.check_loss_input_keys(i, given, loss_fn, spec)
    inputs: dict[str, torch.Tensor] = {}
    for key, array in given.items():
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        want = "int64" if key == "target_tokens" else "float32"
        if array.dtype != want:
            raise EngineInputError(f"{where} is {array.dtype}; send {want}")
        rules.check_loss_input_shape(where, array.shape, n)
        try:
            inputs[key] = to_tensor(array)
        except ValueError as exc:
            raise EngineInputError(f"{where} {exc}") from exc
        if want == "float32" and not bool(torch.isfinite(inputs[key]).all()):
            raise EngineInputError(f"{where} holds NaN or infinity; send finite values")
    target = inputs["target_tokens"].cpu().numpy()
    rules.check_token_ids(f"data[{i}].loss_fn_inputs['target_tokens']", target, limits.vocab_size)
    for key in spec.optional:
        # Every optional input defaults to ones (cross_entropy's `weights`: every token counts).
        inputs.setdefault(key, torch.ones(n, dtype=torch.float32))
    return _Checked(tokens=tokens, inputs=inputs)


def _pad(first: int, rows: list[_Checked]) -> MicroBatch:
    lengths = [len(r.tokens) for r in rows]
    width = max(lengths)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    keys = rows[0].inputs.keys()
    inputs = {k: torch.zeros(len(rows), width, dtype=rows[0].inputs[k].dtype) for k in keys}
    for j, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        tokens[j, :n] = row.tokens
        mask[j, :n] = True
        for k in keys:
            inputs[k][j, :n] = row.inputs[k]
    return MicroBatch(first=first, lengths=lengths, tokens=tokens, mask=mask, inputs=inputs)


def checked_loss(loss_fn: str, given: dict[str, float] | None) -> tuple[LossFn, dict[str, float]]:
    """A call's loss and its config with defaults filled in; EngineInputError otherwise."""
    try:
        fn = LossFn(loss_fn)
    except ValueError as exc:
        known = [f.value for f in LossFn]
        raise EngineInputError(f"unknown loss_fn {loss_fn!r}; use one of {known}") from exc
    try:
        return fn, loss_config(fn, given)
    except ValueError as exc:
        raise EngineInputError(str(exc)) from exc


@dataclass(frozen=True)
class BatchLoss:
    """One micro-batch run through the model: the target tokens' logprobs, the loss
    terms (zero on padding) and their sum."""

    logprobs: torch.Tensor
    terms: torch.Tensor
    loss: torch.Tensor
    mask: torch.Tensor

    def outputs(self, mb: MicroBatch) -> list[dict[str, TensorArray]]:
        """Each datum's `logprobs` and `elementwise_loss`, unpadded, in order."""
        return [
            {
                "logprobs": to_array(self.logprobs[j, :n]),
                "elementwise_loss": to_array(self.terms[j, :n]),
            }
            for j, n in enumerate(mb.lengths)
        ]


def batch_loss(
    model: torch.nn.Module,
    mb: MicroBatch,
    loss_fn: LossFn,
    config: dict[str, float],
    device: torch.device,
    backward: bool,
) -> BatchLoss:
    """The micro-batch's loss on `model`; with `backward`, its gradients added to the
    parameters' own."""
    inputs = {k: v.to(device) for k, v in mb.inputs.items()}
    mask = mb.mask.to(device)
    with torch.set_grad_enabled(backward):
        logits = model(input_ids=mb.tokens.to(device)).logits.float()
        logprobs = -F.cross_entropy(
            logits.flatten(0, 1), inputs["target_tokens"].flatten(), reduction="none"
        ).view_as(mask)
        terms = elementwise_loss(loss_fn, logprobs, inputs, config)
        # where(), not a product: a padded term may be inf or nan.
        terms = torch.where(mask, terms, torch.zeros_like(terms))
        loss = terms.sum()
        if backward:
            loss.backward()
    return BatchLoss(logprobs, terms, loss, mask)
