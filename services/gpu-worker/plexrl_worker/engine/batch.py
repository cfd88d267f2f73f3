"""Validate a forward_backward call's data and pack it into padded micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plexrl.messages import Datum, LossFn
from plexrl_worker.engine.arrays import to_tensor
from plexrl_worker.engine.errors import EngineInputError
from plexrl_worker.engine.losses import LOSS_INPUTS


@dataclass(frozen=True)
class ModelLimits:
    """What the model accepts."""

    vocab_size: int
    max_positions: int


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
    data: list[Datum], loss_fn: LossFn, limits: ModelLimits, max_batch_tokens: int
) -> list[MicroBatch]:
    """Check every datum (raising EngineInputError naming the datum and the fix), then pack."""
    if not data:
        raise EngineInputError("data is empty; send at least one datum")
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
    if n == 0:
        raise EngineInputError(f"data[{i}] has no tokens; every datum needs at least one")
    if n > limits.max_positions:
        raise EngineInputError(
            f"data[{i}] has {n} tokens, more than the model's {limits.max_positions} positions; "
            "shorten or split it"
        )
    try:
        tokens = torch.tensor(datum.tokens, dtype=torch.int64)
    except (OverflowError, RuntimeError) as exc:
        raise EngineInputError(f"data[{i}].tokens holds an id beyond 64 bits: {exc}") from exc
    _check_ids(f"data[{i}].tokens", tokens, limits.vocab_size)

    spec = LOSS_INPUTS[loss_fn]
    given = datum.loss_fn_inputs
    missing = [k for k in ("target_tokens", *spec.required) if k not in given]
    if missing:
        raise EngineInputError(
            f"data[{i}].loss_fn_inputs lacks {missing}; {loss_fn} needs "
            f"{['target_tokens', *spec.required]}"
        )
    unknown = sorted(set(given) - set(spec.accepted))
    if unknown:
        raise EngineInputError(
            f"data[{i}].loss_fn_inputs has {unknown}, which {loss_fn} does not read; "
            f"it accepts {list(spec.accepted)}"
        )
    inputs: dict[str, torch.Tensor] = {}
    for key, array in given.items():
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        want = "int64" if key == "target_tokens" else "float32"
        if array.dtype != want:
            raise EngineInputError(f"{where} is {array.dtype}; send {want}")
        if array.shape != [n]:
            raise EngineInputError(
                f"{where} has shape {array.shape}, but the datum has {n} tokens; "
                f"send one value per token (shape [{n}])"
            )
        try:
            inputs[key] = to_tensor(array)
        except ValueError as exc:
            raise EngineInputError(f"{where} {exc}") from exc
        if want == "float32" and not bool(torch.isfinite(inputs[key]).all()):
            raise EngineInputError(f"{where} holds NaN or infinity; send finite values")
    _check_ids(
        f"data[{i}].loss_fn_inputs['target_tokens']", inputs["target_tokens"], limits.vocab_size
    )
    for key in spec.optional:
        # Every optional input defaults to ones (cross_entropy's `weights`: every token counts).
        inputs.setdefault(key, torch.ones(n, dtype=torch.float32))
    return _Checked(tokens=tokens, inputs=inputs)


def _check_ids(where: str, ids: torch.Tensor, vocab_size: int) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise EngineInputError(
            f"{where}[{pos}] is {int(ids[pos])}, outside the vocabulary [0, {vocab_size}); "
            "tokenize with the base model's tokenizer"
        )


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
