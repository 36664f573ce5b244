"""Element types and reductions of the collective library, in numpy (compiled loops,
never per element in Python).

bfloat16 has no numpy type: its arrays are stored as uint16 (the top half of a float32)
and reduced through float32, rounding back to nearest-even as PyTorch does.  float16 is
reduced in float16, as NCCL reduces half precision step by step.
"""
from __future__ import annotations

import enum

import numpy as np


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"

    @classmethod
    def of(cls, v) -> "ReduceOp":
        if isinstance(v, ReduceOp):
            return v
        try:
            return cls(str(v).lower())
        except ValueError:
            raise ValueError("reduce op %r: use one of %s" % (v, ", ".join(o.value for o in cls))) from None


# name -> (numpy storage dtype, element size); bfloat16 lives in uint16
DTYPES = {
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32), "int64": np.dtype(np.int64), "uint8": np.dtype(np.uint8),
}
_BY_NUMPY = {v: k for k, v in DTYPES.items() if k != "bfloat16"}


def dtype_name(arr: np.ndarray, dtype: str | None) -> str:
    """The element type of arr as the library names it; dtype='bfloat16' marks uint16
    storage as bfloat16."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError("dtype %r: use one of %s" % (dtype, ", ".join(DTYPES)))
        if DTYPES[dtype] != arr.dtype:
            raise ValueError("dtype %s needs %s storage, the array is %s" % (dtype, DTYPES[dtype], arr.dtype))
        return dtype
    try:
        return _BY_NUMPY[arr.dtype]
    except KeyError:
        raise ValueError("dtype %s is not supported (use one of %s)" % (arr.dtype, ", ".join(DTYPES))) from None


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f: np.ndarray, out: np.ndarray) -> None:
    """Round float32 to bfloat16 (nearest, ties to even; NaN stays a quiet NaN) into out."""
    u = f.view(np.uint32)
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    np.copyto(out, np.where(np.isnan(f), np.uint32(0x7FC0), r).astype(np.uint16))


_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp, dtype: str) -> None:
    """dst = op(dst, src), elementwise and in place (AVG sums: divide() finishes it)."""
    f = _UFUNC[op]
    if dtype == "bfloat16":
        f32_to_bf16(f(bf16_to_f32(dst), bf16_to_f32(src)), dst)
    else:
        f(dst, src, out=dst)


def divide(arr: np.ndarray, n: int, dtype: str) -> None:
    """AVG's last step: floats divided by n; integers floor-divided (documented)."""
    if dtype == "bfloat16":
        f32_to_bf16(bf16_to_f32(arr) / np.float32(n), arr)
    elif arr.dtype.kind == "f":
        np.divide(arr, arr.dtype.type(n), out=arr)
    else:
        np.floor_divide(arr, n, out=arr)
