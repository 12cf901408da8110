"""Triton where it is installed, and a clear error at launch where it is not.

The kernel modules define their Triton kernels at import time (`@triton.jit`, `tl.constexpr`
annotations), but only CUDA tensors (or tests under TRITON_INTERPRET=1) ever launch them; the CPU
path runs the pure-torch references. Triton's wheel is about 1 GB, so the CPU container image
leaves it out. There, `triton` and `tl` below are stand-ins: defining a kernel works, and any use
of one (a launch, `triton.next_power_of_2`, ...) raises `TritonMissingError` saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["HAVE_TRITON", "TritonMissingError", "tl", "triton"]


class TritonMissingError(RuntimeError):
    """A Triton kernel was asked for where Triton is not installed."""


class _Absent:
    """Stands in for the `triton` or `triton.language` module. Attribute access succeeds (for
    decorators and annotations at import time); calling or indexing what it returns raises."""

    def __init__(self, name: str, reason: str) -> None:
        self._name = name
        self._reason = reason

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        if attribute == "jit" and self._name == "triton":
            return self._jit
        return _Unusable(f"{self._name}.{attribute}", self._reason)

    def _jit(self, fn: Callable | None = None, **_options: Any) -> Any:
        if fn is None:  # @triton.jit(...) with options
            return lambda inner: _Unusable(f"Triton kernel {inner.__name__}", self._reason)
        return _Unusable(f"Triton kernel {fn.__name__}", self._reason)


class _Unusable:
    def __init__(self, what: str, reason: str) -> None:
        self._what = what
        self._reason = reason

    def _fail(self, *_args: Any, **_kwargs: Any) -> Any:
        raise TritonMissingError(
            f"{self._what} needs Triton, which is not installed ({self._reason}); "
            "CPU tensors run the torch reference: leave use_triton unset"
        )

    __call__ = _fail
    __getitem__ = _fail


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ModuleNotFoundError as missing:
    HAVE_TRITON = False
    triton = _Absent("triton", str(missing))
    tl = _Absent("triton.language", str(missing))
