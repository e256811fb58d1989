"""Argument checks shared by every public entry point.

Note [Argument errors]
~~~~~~~~~~~~~~~~~~~~~~
A caller's mistake is raised before anything changes, and its message names the argument (as
``Config.max_blocks``, ``n``, ``timeout``...) and the value received:

* ``TypeError``: the value has the wrong type. ``bool`` is never a number here, although Python
  makes it an ``int``: ``alloc(True)`` or ``timeout=True`` is a mistake, not 1 block or 1 second.
* ``ValueError``: the type is right, the value is out of range (negative, NaN, infinite, beyond
  what the C++ core's int64 holds, ...).

A tensor's dtype is part of its type here: float ids, or an ``out``/``src`` of another dtype than
the KV cache's, are a ``TypeError``; a wrong shape or device is a ``ValueError``. Every public
method of ``Allocator`` and ``SyncAllocator`` follows this, tests/test_fuzz_args.py checks it
parameter by parameter (issue 27 found ``set_demand``, ``free_block_ids``, the block operations and
the facade's ``deadline`` raising ``ValueError`` for a wrong type).

These helpers are called at the top of each public method, before the C++ pool sees the value, so
that no value reaches pybind11's conversion (whose error is a signature dump naming no argument).
The hot paths (``alloc`` of a plain positive int, ``free`` of a list) test the common case inline
and call these only when it does not hold.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "INT64_MAX",
    "block_ids",
    "count",
    "deadline",
    "flag",
    "index",
    "instance",
    "integer",
    "number",
    "seconds",
    "type_name",
]

INT64_MAX = (1 << 63) - 1
"""The largest count, size or id the C++ core holds."""


def type_name(value: object) -> str:
    """How an error message names a value's type."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def integer(
    value: object, name: str, *, minimum: int | None = None, maximum: int = INT64_MAX
) -> int:
    """``value`` as an int in ``[minimum, maximum]``.

    Anything with ``__index__`` (numpy integers, 0-d integer tensors) counts; bools do not.

    Raises:
        TypeError: not an integer, or a bool.
        ValueError: out of range.
    """
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type_name(value)} ({value!r})") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    if result > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {result}")
    return result


def count(value: object, name: str) -> int:
    """A positive int (a number of blocks, failures...).

    Raises:
        TypeError: not an integer, or a bool.
        ValueError: zero, negative or beyond int64.
    """
    result = integer(value, name)
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {result}")
    return result


def index(value: object, name: str, size: int) -> int:
    """An index into a sequence of ``size`` items.

    Raises:
        TypeError: not an integer, or a bool.
        IndexError: not in ``range(size)`` (what indexing a Python sequence raises).
    """
    i = integer(value, name, minimum=None)
    if not 0 <= i < size:
        raise IndexError(f"{name} {i} out of range [0, {size})")
    return i


def number(value: object, name: str, what: str = "a real number") -> float:
    """``value`` as a float: any real number but a bool (NaN and infinities pass: check them).

    Raises:
        TypeError: not a real number, or a bool.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type_name(value)} ({value!r})")
    return float(value)


def seconds(value: object, name: str, *, positive: bool = False) -> float:
    """A finite duration in seconds, ``>= 0`` (``> 0`` when ``positive``).

    Raises:
        TypeError: not a real number, or a bool.
        ValueError: NaN, infinite, negative (or zero when ``positive``).
    """
    result = number(value, name, "a number of seconds")
    if not math.isfinite(result) or result < 0 or (positive and result == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return result


def deadline(value: object, name: str, clock: str = "loop.time()") -> float:
    """A value of ``clock`` (``loop.time()``, ``time.monotonic()``): finite and ``>= 0`` (both
    are monotonic clocks, from boot).

    A deadline already past is valid: the call then behaves as with ``timeout=0``.

    Raises:
        TypeError: not a real number, or a bool.
        ValueError: NaN, infinite or negative.
    """
    result = number(value, name, f"a {clock} value")
    if not math.isfinite(result) or result < 0:
        raise ValueError(f"{name} must be a finite {clock} value >= 0, got {value!r}")
    return result


def flag(value: object, name: str) -> bool:
    """A bool, and only a bool (``1`` or ``"yes"`` is a mistake, not True).

    Raises:
        TypeError: anything else.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type_name(value)} ({value!r})")
    return value


def instance(value: object, name: str, kind: type[Any], *, optional: bool = False) -> Any:
    """``value`` itself, checked to be a ``kind`` (or None when ``optional``).

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, kind) or (optional and value is None):
        return value
    expected = f"a {kind.__name__}{' or None' if optional else ''}"
    raise TypeError(f"{name} must be {expected}, got {type_name(value)}")


def block_ids(value: object, name: str) -> Sequence[int] | list[int]:
    """Block ids for the C++ pool: a sequence of ints, or a 1-D integer tensor or numpy array.

    Sets and dicts are refused (an unordered or keyed collection of ids is a mistake: a dict would
    free its keys), and so are strings, bytes and tensors of another shape or dtype. The elements
    of a sequence are checked by the pool (ints, not bools, in range, allocated, distinct).

    Raises:
        TypeError: not such a sequence or tensor.
        ValueError: a tensor or array that is not 1-D.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must be a 1-D integer tensor, got {type_name(value)}")
        if value.dim() != 1 or value.device.type == "meta":  # a meta tensor holds no values
            raise ValueError(f"{name} must be a 1-D integer tensor, got {type_name(value)}")
        ids: list[int] = value.tolist()
        return ids
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array, got dtype {value.dtype}")
        if value.ndim != 1:
            raise ValueError(f"{name} must be a 1-D integer array, got shape {value.shape}")
        array_ids: list[int] = value.tolist()
        return array_ids
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray):
        return value
    raise TypeError(
        f"{name} must be a sequence of ints or a 1-D integer tensor, got {type_name(value)}"
    )
