"""safetensors dtype names: item sizes and the torch dtypes they map to."""
from __future__ import annotations

import torch

from .errors import CheckpointError

# name -> (itemsize in bytes, torch dtype attribute name)
_DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "U16": (2, "uint16"),
    "U32": (4, "uint32"),
    "U64": (8, "uint64"),
}

SUPPORTED = tuple(_DTYPES)


def itemsize(name: str) -> int:
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; expected one of {', '.join(SUPPORTED)}") from None


def is_known(name: str) -> bool:
    return name in _DTYPES


def torch_dtype(name: str) -> torch.dtype:
    size, attr = _DTYPES[name]
    dt = getattr(torch, attr, None)
    if dt is None:  # very old torch without unsigned types: same bits, same size
        dt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return dt


def from_torch(dt: torch.dtype) -> str:
    for name, (_, attr) in _DTYPES.items():
        if getattr(torch, attr, None) == dt:
            return name
    raise CheckpointError(f"torch dtype {dt} has no safetensors name")


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(name: str) -> torch.dtype:
    """Integer dtype of the same width: digests and byte compares work on raw bits."""
    return _BITS_VIEW[itemsize(name)]
