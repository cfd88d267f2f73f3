"""A job's state as flat tensors, and its safetensors bytes (host and disk tiers).

Keys: `weights.<param>`, `grads.<param>`, and `optim.<param>.{exp_avg,exp_avg_sq,step}`,
where `<param>` is a stable name that does not depend on where the job ran (LoRA
parameters carry no adapter slot name). `metadata` is JSON-able: the JobSpec and counters.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from plexrl.messages import JobSpec

WEIGHTS = "weights."
GRADS = "grads."
OPTIM = "optim."
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")

_FORMAT = "plexrl.job_state/1"
META_KEY = "plexrl"

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


@dataclass
class JobTensors:
    """A CPU copy of (part of) a job's state."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-able: `spec` (a JobSpec as builtins), `steps`, `kind` (`lora` or `full`)."""

    @property
    def spec(self) -> JobSpec:
        return msgspec.convert(self.metadata["spec"], JobSpec)

    @property
    def steps(self) -> int:
        return int(self.metadata.get("steps", 0))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def has(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.tensors)


def make_metadata(spec: JobSpec, steps: int) -> dict[str, Any]:
    kind = "full" if spec.lora is None else "lora"
    return {"format": _FORMAT, "spec": msgspec.to_builtins(spec), "steps": steps, "kind": kind}


def state_to_bytes(state: JobTensors) -> bytes:
    """Safetensors bytes; the metadata travels as one JSON string in the header."""
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in state.tensors.items()}
    return st_save(tensors, metadata={META_KEY: json.dumps(state.metadata)})


_ST_DTYPES = {
    torch.float64: "F64",
    torch.int64: "I64",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


_TORCH_DTYPES = {name: dtype for dtype, name in _ST_DTYPES.items()}


@dataclass(frozen=True)
class StateStream:
    """A job state's safetensors bytes as a sequence of pieces, not one buffer: the
    header, then each tensor's own memory in slices (no copy). Writing it out lets the
    event loop run between pieces, where building one `bytes` of a large state would
    hold the interpreter for as long as it takes to copy it all. `b"".join(chunks())`
    is byte for byte what `state_to_bytes` gives."""

    header: bytes
    tensors: tuple[torch.Tensor, ...]
    size: int
    """Bytes in all."""
    chunk_bytes: int = 1 << 20

    def chunks(self) -> Iterator[bytes | memoryview]:
        yield self.header
        for t in self.tensors:
            if t.numel() == 0:
                continue
            view = t.view(-1).view(torch.uint8).numpy().data
            for start in range(0, len(view), self.chunk_bytes):
                yield view[start : start + self.chunk_bytes]


def _safetensors_order(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The order safetensors lays these tensors out in (by dtype, then by name), asked of
    safetensors itself over empty tensors of the same names and dtypes: no data copied."""
    empty = {k: torch.empty(0, dtype=t.dtype) for k, t in tensors.items()}
    raw = st_save(empty)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return [k for k in header if k != "__metadata__"]


def state_stream(state: JobTensors) -> StateStream:
    """The state's safetensors bytes as a `StateStream`, laid out as safetensors lays
    them (its tensor order; the header's JSON padded with spaces to 8 bytes), so it
    reads back with any safetensors reader and hashes as `state_to_bytes` does."""
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in state.tensors.items()}
    order = _safetensors_order(tensors)
    entries: dict[str, Any] = {"__metadata__": {META_KEY: json.dumps(state.metadata)}}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, which a job state never holds")
        nbytes = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    header = len(text).to_bytes(8, "little") + text
    return StateStream(header, tuple(tensors[n] for n in order), len(header) + offset)


def state_from_bytes(data: bytes | bytearray | memoryview) -> JobTensors:
    """Inverse of `state_to_bytes`; ValueError if the bytes are not a PlexRL job state.

    Each tensor is copied out of `data` by torch, which lets go of the interpreter while
    it copies: run in a thread, a large state's parse leaves the event loop free (the
    same tensors, bit for bit, as safetensors' own reader gives)."""
    header, meta = _header(data)
    start = 8 + int.from_bytes(bytes(data[:8]), "little")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES.get(entry.get("dtype"))
        if dtype is None:  # not one a job state holds: safetensors' reader knows it all
            return JobTensors(tensors=dict(st_load(bytes(data))), metadata=meta)
        lo, hi = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=dtype)
        if hi - lo != out.numel() * out.element_size() or start + hi > len(data):
            raise ValueError(f"job state tensor {name} does not fit its offsets {lo}..{hi}")
        if hi > lo:
            with warnings.catch_warnings():  # read only: the source is never written
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(data, dtype=torch.uint8, count=hi - lo, offset=start + lo)
            out.view(-1).view(torch.uint8).copy_(source)
        tensors[name] = out
    return JobTensors(tensors=tensors, metadata=meta)


def _header(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, Any]]:
    header_len = int.from_bytes(bytes(data[:8]), "little") if len(data) >= 8 else 0
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
        meta = json.loads(header["__metadata__"][META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError("these bytes are not a PlexRL job state (no plexrl metadata)") from exc
    if meta.get("format") != _FORMAT:
        raise ValueError(f"job state format {meta.get('format')!r} is not {_FORMAT!r}")
    return header, meta


def export_params(params: NamedParams, *, gradients: bool) -> dict[str, torch.Tensor]:
    """Weights (and accumulated gradients, where there are any) as CPU copies."""
    out: dict[str, torch.Tensor] = {}
    for name, p in params:
        out[WEIGHTS + name] = host_copy(p.detach())
        if gradients and p.grad is not None:
            out[GRADS + name] = host_copy(p.grad)
    return out


def export_adam(params: NamedParams, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW moments and step counts of the parameters that have taken a step."""
    out: dict[str, torch.Tensor] = {}
    for name, p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if key in ADAM_KEYS:
                out[f"{OPTIM}{name}.{key}"] = host_copy(value)
    return out


def import_params(
    params: NamedParams, tensors: dict[str, torch.Tensor], *, gradients: bool
) -> None:
    """Copy weights (and gradients) into live parameters; ValueError on a mismatch."""
    expected = {WEIGHTS + name for name, _ in params}
    given = {k for k in tensors if k.startswith(WEIGHTS)}
    if expected != given:
        missing, extra = sorted(expected - given)[:5], sorted(given - expected)[:5]
        raise ValueError(
            f"the state's weights do not fit this job: missing {missing}, unexpected {extra} "
            "(was it saved for another base model or LoRA configuration?)"
        )
    with torch.no_grad():
        for name, p in params:
            src = tensors[WEIGHTS + name]
            if src.shape != p.shape:
                raise ValueError(
                    f"weight {name} has shape {list(src.shape)}, the job's is {list(p.shape)}"
                )
            p.copy_(src)
            grad = tensors.get(GRADS + name) if gradients else None
            p.grad = None if grad is None else grad.to(p.device, p.dtype, copy=True)


def import_adam(
    params: NamedParams, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Restore AdamW state exactly as `export_adam` saw it."""
    for name, p in params:
        keys = [f"{OPTIM}{name}.{k}" for k in ADAM_KEYS]
        present = [k in tensors for k in keys]
        if not any(present):
            continue  # this parameter never took a step
        if not all(present):
            raise ValueError(f"optimizer state of {name} is incomplete; it needs {ADAM_KEYS}")
        exp_avg, exp_avg_sq, step = (tensors[k] for k in keys)
        optimizer.state[p] = {
            # AdamW keeps `step` on the CPU unless it runs capturable or fused.
            "step": step.clone(),
            "exp_avg": exp_avg.to(p.device, copy=True, non_blocking=True),
            "exp_avg_sq": exp_avg_sq.to(p.device, copy=True, non_blocking=True),
        }


def empty_params(params: NamedParams, optimizer: torch.optim.Optimizer | None) -> None:
    """Free a job's tensors but keep its modules and optimizer, for `refill_params`."""
    with torch.no_grad():
        for _, p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
    if optimizer is not None:
        optimizer.state.clear()


def refill_params(
    params: NamedParams,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
) -> None:
    """Put back exactly what `export_params` + `export_adam` took from emptied parameters."""
    with torch.no_grad():
        for name, p in params:
            # Asynchronous from pinned memory; later kernels on the stream wait for it.
            p.data = tensors[WEIGHTS + name].to(device, p.dtype, copy=True, non_blocking=True)
            grad = tensors.get(GRADS + name)
            p.grad = (
                None if grad is None else grad.to(device, p.dtype, copy=True, non_blocking=True)
            )
    import_adam(params, optimizer, tensors)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that aliases nothing live (a copy even on the CPU: training goes on).

    From a CUDA device it lands in pinned host memory, asynchronously (call
    `wait_for_copies` before reading it): torch's caching host allocator hands the
    pinned blocks of states dropped earlier to later copies, so after the first swap a
    job's state moves at the host link's speed instead of page-faulting fresh memory.
    """
    if t.is_cuda:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t.detach(), non_blocking=True)
        return out
    return t.detach().to("cpu", copy=True).contiguous()


def wait_for_copies(device: torch.device) -> None:
    """Block until the asynchronous device-to-host copies of `host_copy` have landed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
