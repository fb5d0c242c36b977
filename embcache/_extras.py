"""The optional parts of embcache and the extras that install them.

The core install (``pip install embcache``) is the embedded cache: ``EmbeddingCache``, the torch
modules, keysets, prefetch and its Prometheus collector. The rest needs an extra:

* ``server``: gRPC and protobuf, for ``embcache-server``, :class:`embcache.Client` (and the fleet's
  errors), ``embcache reshard``;
* ``sizing``: matplotlib, for the plot of ``embcache sizing``;
* ``torchrec``: TorchRec's pure-Python dependencies (see ``scripts/install-torchrec.sh``).

:func:`missing_extra` turns the ImportError of a missing optional dependency into one that says
which extra to install.
"""

from __future__ import annotations

__all__ = ["EXTRA_OF", "MissingExtraError", "missing_extra"]

#: Top-level module of an optional dependency -> the extra that installs it.
EXTRA_OF: dict[str, str] = {
    "grpc": "server",
    "grpc_health": "server",
    "grpc_reflection": "server",
    "google": "server",  # protobuf
    "tomli": "server",
    "matplotlib": "sizing",
}


class MissingExtraError(ImportError):
    """A part of embcache was used whose optional dependencies are not installed.

    Attributes:
        extra: the extra that installs them (``pip install 'embcache[<extra>]'``).
    """

    def __init__(self, what: str, extra: str, module: str) -> None:
        super().__init__(f"{what} needs the '{extra}' extra ({module} is not installed): "
                         f"pip install 'embcache[{extra}]'", name=module)
        self.extra = extra


def missing_extra(exc: ImportError, what: str) -> ImportError:
    """A :class:`MissingExtraError` naming the extra for ``exc`` when it is a missing optional
    dependency (or already one), else ``exc`` itself (a real bug must not pass for a missing extra)."""
    if isinstance(exc, MissingExtraError):
        return exc
    module = exc.name or ""
    extra = EXTRA_OF.get(module.split(".")[0]) if isinstance(exc, ModuleNotFoundError) else None
    return exc if extra is None else MissingExtraError(what, extra, module)
