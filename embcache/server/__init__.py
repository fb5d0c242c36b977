"""The embcache parameter server: ``embcache-server`` serves an EmbeddingCache over gRPC.

See :mod:`embcache.server.main` for flags, the config file and the durability modes, and
:mod:`embcache.server.servicer` for the thin adapter between the protocol and the library.
"""

from .main import RunningServer, ServerSettings, load_settings, main, start_server

__all__ = ["RunningServer", "ServerSettings", "load_settings", "main", "start_server"]
