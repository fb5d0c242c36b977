"""The embcache parameter server: ``embcache-server`` serves an EmbeddingCache over gRPC.

See :mod:`embcache.server.main` for flags, the config file and the durability modes (its
docstring is ``embcache-server --help``), :mod:`embcache.server.settings` for how the settings
are read and checked, :mod:`embcache.server.serve` for starting and stopping a server, and
:mod:`embcache.server.servicer` for the thin adapter between the protocol and the library.
"""

from .._extras import missing_extra

try:
    from .main import RunningServer, ServerSettings, load_settings, main, start_server
except ImportError as _exc:  # gRPC missing: say which extra installs it
    _err = missing_extra(_exc, "embcache.server")
    if _err is _exc:
        raise
    raise _err from _exc

__all__ = ["RunningServer", "ServerSettings", "load_settings", "main", "start_server"]
