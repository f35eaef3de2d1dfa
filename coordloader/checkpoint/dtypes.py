"""safetensors dtype names: item sizes and the torch dtypes they map to."""
from __future__ import annotations

import torch

from coordloader.errors import CheckpointError

# name -> (itemsize in bytes, torch dtype); torch >= 2.8 (pyproject) has all of them
_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F64": (8, torch.float64),
    "F32": (4, torch.float32),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I64": (8, torch.int64),
    "I32": (4, torch.int32),
    "I16": (2, torch.int16),
    "I8": (1, torch.int8),
    "U8": (1, torch.uint8),
    "BOOL": (1, torch.bool),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
    "U16": (2, torch.uint16),
    "U32": (4, torch.uint32),
    "U64": (8, torch.uint64),
    "F8_E8M0": (1, torch.float8_e8m0fnu),   # MX block scales
    "C64": (8, torch.complex64),
}
# Not read: F4, F6_E2M3, F6_E3M2 (elements smaller than a byte, which no byte run of a
# slice can cut) and C128 (no safetensors writer has it)
_FROM_TORCH = {dt: name for name, (_, dt) in _DTYPES.items()}

SUPPORTED = tuple(_DTYPES)


def itemsize(name: str) -> int:
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; expected one of {', '.join(SUPPORTED)}") from None


def is_known(name: str) -> bool:
    return name in _DTYPES


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name][1]


def from_torch(dt: torch.dtype) -> str:
    try:
        return _FROM_TORCH[dt]
    except KeyError:
        raise CheckpointError(f"torch dtype {dt} has no safetensors name") from None


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(name: str) -> torch.dtype:
    """Integer dtype of the same width: digests and byte compares work on raw bits."""
    return _BITS_VIEW[itemsize(name)]
