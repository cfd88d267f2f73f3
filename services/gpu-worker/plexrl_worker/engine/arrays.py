"""TensorArray (wire) <-> torch.Tensor, without a round trip through Python lists."""

from __future__ import annotations

import sys

import torch

from plexrl.messages import TensorArray
from plexrl.messages.common import TensorDtype

# TensorArray bytes are little-endian; reading them as native memory is only right here.
if sys.byteorder != "little":
    raise ImportError("the engine's TensorArray conversion assumes a little-endian host")

_TORCH_DTYPES: dict[TensorDtype, torch.dtype] = {"int64": torch.int64, "float32": torch.float32}
_WIRE_DTYPES: dict[torch.dtype, TensorDtype] = {v: k for k, v in _TORCH_DTYPES.items()}


def to_tensor(array: TensorArray) -> torch.Tensor:
    """A CPU tensor over a copy of the array's bytes; raises ValueError if they do not add up."""
    dtype = _TORCH_DTYPES[array.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(array.data) != array.numel * itemsize:
        raise ValueError(
            f"holds {len(array.data)} bytes, but shape {array.shape} of {array.dtype} "
            f"needs {array.numel * itemsize}"
        )
    if array.numel == 0:
        return torch.empty(array.shape, dtype=dtype)
    return torch.frombuffer(bytearray(array.data), dtype=dtype).reshape(array.shape)


def to_array(tensor: torch.Tensor) -> TensorArray:
    """A wire array of a float32 or int64 tensor (copied to the CPU)."""
    dtype = _WIRE_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"only float32 and int64 tensors go on the wire, not {tensor.dtype}")
    cpu = tensor.detach().to("cpu").contiguous()
    return TensorArray(dtype=dtype, shape=list(cpu.shape), data=cpu.numpy().tobytes())
