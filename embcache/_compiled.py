"""Compiling a module's numba kernels once, up front, with torch operations as the fallback."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np


def compile_once(kernels: dict[str, Any], build: Callable[[], dict[str, Any]], what: str) -> bool:
    """Whether ``kernels`` can run: ``build()`` compiles them (or numba loads them from its disk
    cache) and runs each once, tried at the first call and remembered, so that no lookup pays for
    a compilation. Without numba the answer is False, silently; a numba or LLVM that fails to
    build them gives one warning naming ``what``, and the caller uses its torch operations."""
    if "ok" not in kernels:
        kernels["ok"] = False
        try:
            built = build()
        except ImportError:
            return False
        except Exception as exc:  # a numba or LLVM that cannot build them: the torch operations
            warnings.warn(f"embcache: the {what} compiled kernels are unavailable ({exc!r}); "
                          "using torch operations", stacklevel=3)
            return False
        kernels.update(built)
        kernels["ok"] = True
    return bool(kernels["ok"])


def _no_prefetch(ary: Any, idx: Any) -> None:
    pass


def prefetch(numba: Any) -> Any:
    """A function for compiled kernels, ``prefetch(ary, idx)``: LLVM's prefetch of ``&ary[idx]``
    (``idx`` a tuple of one index per dimension), or a no-op where this LLVM lacks it. Kernels
    that read rows at random prefetch those a few places on, so that their misses overlap."""
    from .index.numba_index import _prefetch_intrinsic

    try:
        fn = _prefetch_intrinsic(numba)
        numba.njit(nogil=True)(lambda a: fn(a, (0,)))(np.zeros(1, np.float32))
        return fn
    except Exception:  # an LLVM without the intrinsic: same kernels, no prefetch
        return numba.njit(cache=True, nogil=True, inline="always")(_no_prefetch)
