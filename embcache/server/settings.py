"""The server's settings (:class:`ServerSettings`) and where they come from.

A config file (TOML, or JSON when the name ends in .json: :func:`read_settings_file`), then
``EMBCACHE_<SETTING>`` environment variables (:func:`apply_environment`), then the command-line
flags (:func:`embcache.server.main.load_settings`, which applies them over these); the result is
typed and checked by :func:`check_settings`. Every value is checked against the type its
dataclass declares (:func:`typed_value`), and sizes in bytes also take units
(:func:`parse_size`: "4GiB", "512MB"). The keys are described in ``embcache-server --help``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import CacheConfig, TableConfig
from ..errors import ConfigError
from .leases import MIN_TTL_SECONDS

__all__ = ["ServerSettings", "apply_environment", "check_settings", "parse_size", "read_settings_file",
           "typed_value"]


@dataclass
class ServerSettings:
    """Everything the server needs; built from the config file, the environment and flags by
    :func:`embcache.server.main.load_settings`.

    Args:
        listen: ``HOST:PORT`` to bind (port 0: a free port).
        cache: keyword arguments of :class:`~embcache.CacheConfig` (``path``, ``hbm_bytes``, ...).
        tables: tables to open or create at start.
        metrics_port: Prometheus HTTP port (-1: none, 0: a free port).
        metrics_host: address of the metrics server (default 127.0.0.1).
        max_message_bytes: largest message in either direction (default 64 MiB).
        max_lease_seconds: the longest time-to-live a batch lease is granted (default 600): a
            client that stops renewing its leases (crashed, cut off) pins rows at most this long.
        workers: threads serving unary calls (default 4 per core, at least 8).
        stream_workers: threads serving the calls that stream, either way (default half of
            ``workers``, at least 2): streams never take the unary calls' threads, and wait in a
            queue (holding no thread) when these are all busy. Health checks have 2 of their own.
        stream_idle_seconds: a client stream that sends no message for this long is cut
            (cancelled, nothing of it applied; default 30).
        torch_threads: torch's intra-op threads (0: torch's default, one per core). Concurrent
            calls already use the cores; 1 avoids threads waiting on each other on a busy machine.
        checkpoint_root: Checkpoint writes only under here (default ``<path>/checkpoints``).
        flush_every_updates, flush_interval_seconds, sync: durability (see the module docs).
        grace_seconds: how long shutdown waits for calls in flight.
        drain_seconds: how long shutdown stays NOT_SERVING, refusing new calls, before it stops
            listening (time for load balancers and clients to notice; default 0).
        tls_cert, tls_key, tls_client_ca: PEM files (TLS; with a client CA, mutual TLS).
        auth_token_files, auth_readonly_token_files: files of bearer tokens, one per line.
        port_file: a JSON file written once serving: ``{"port", "metrics_port", "pid"}``.
        serve: serving mode: serve the export in this directory read-only
            (:mod:`embcache.server.serving`; the store is a fresh directory under ``path``).
        follow: serving mode: apply each new version of the export as it appears.
        follow_interval_seconds: how often ``follow`` looks for a new version (default 1).
        unknown_rows: serving mode: what a key the model lacks gets: "zeros" (default) or
            "init" (the table's initializer); it never creates a row.
    """

    listen: str = "127.0.0.1:50051"
    cache: dict[str, Any] = field(default_factory=dict)
    tables: list[TableConfig] = field(default_factory=list)
    metrics_port: int = 9400
    metrics_host: str = "127.0.0.1"
    max_message_bytes: int = 64 << 20
    max_lease_seconds: float = 600.0
    workers: int = 0
    stream_workers: int = 0
    stream_idle_seconds: float = 30.0
    torch_threads: int = 0
    checkpoint_root: str | None = None
    flush_every_updates: int = 0
    flush_interval_seconds: float = 0.0
    sync: bool = False
    grace_seconds: float = 30.0
    drain_seconds: float = 0.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_files: list[str] = field(default_factory=list)
    auth_readonly_token_files: list[str] = field(default_factory=list)
    port_file: str | None = None
    serve: str | None = None
    follow: bool = False
    follow_interval_seconds: float = 1.0
    unknown_rows: str = "zeros"

    def cache_config(self) -> CacheConfig:
        """The CacheConfig to open (``path`` defaults to ./embcache-data).

        Raises:
            ConfigError: an unknown or invalid field.
        """
        names = {f.name for f in dataclasses.fields(CacheConfig)}
        unknown = set(self.cache) - names
        if unknown:
            raise ConfigError(f"unknown [cache] fields {sorted(unknown)}; allowed: {sorted(names)}")
        return CacheConfig(**self.cache)


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data = tomllib.loads(raw.decode())
    except ValueError as exc:
        raise ConfigError(f"config file {path!r} is not valid {'JSON' if path.endswith('.json') else 'TOML'}: "
                          f"{exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a table/object at the top level")
    return data


#: The config file's top-level keys that set a setting of the same name.
_SCALAR_KEYS = ("listen", "metrics_port", "metrics_host", "max_message_bytes", "max_lease_seconds", "workers",
                "stream_workers", "stream_idle_seconds", "torch_threads", "checkpoint_root", "grace_seconds",
                "drain_seconds", "port_file")
#: The config file's sections besides [cache] and [[tables]], and their keys.
_SECTION_KEYS = {
    "durability": {"flush_every_updates", "flush_interval_seconds", "sync"},
    "tls": {"cert", "key", "client_ca"},
    "auth": {"token_file", "readonly_token_file"},
    "serving": {"directory", "follow", "follow_interval_seconds", "unknown_rows"},
}
_TOP_KEYS = {*_SCALAR_KEYS, "cache", "tables", *_SECTION_KEYS}


def read_settings_file(path: str) -> ServerSettings:
    """The settings of a config file (TOML, or JSON when the name ends in .json), the rest defaults.

    Raises:
        ConfigError: the file cannot be read or parsed, or holds an unknown key or table field.
    """
    return _settings_from_dict(_read_config(path))


def _settings_from_dict(data: Mapping[str, Any]) -> ServerSettings:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown config keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    for section, keys in _SECTION_KEYS.items():
        extra = set(data.get(section, {})) - keys
        if extra:
            raise ConfigError(f"unknown [{section}] keys {sorted(extra)}; allowed: {sorted(keys)}")
    s = ServerSettings()
    for key in _SCALAR_KEYS:
        if key in data:
            setattr(s, key, data[key])
    s.cache = dict(data.get("cache", {}))
    s.tables = [TableConfig.from_dict(t) for t in data.get("tables", [])]
    for key, value in data.get("durability", {}).items():
        setattr(s, key, value)
    tls = data.get("tls", {})
    s.tls_cert, s.tls_key, s.tls_client_ca = tls.get("cert"), tls.get("key"), tls.get("client_ca")
    auth = data.get("auth", {})
    s.auth_token_files = [auth["token_file"]] if "token_file" in auth else []
    s.auth_readonly_token_files = [auth["readonly_token_file"]] if "readonly_token_file" in auth else []
    serving = dict(data.get("serving", {}))
    if "directory" in serving:
        s.serve = serving.pop("directory")
    for key, value in serving.items():
        setattr(s, key, value)
    return s


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
#: Settings (and CacheConfig fields) that are sizes in bytes: they also take units ("4GiB", "512 MB").
_SIZES = {"max_message_bytes", "hbm_bytes", "ddr_bytes", "block_cache_bytes"}


def parse_size(value: Any, what: str) -> int:
    """Bytes from an integer or a string with a unit (``"4GiB"``, ``"512MB"``, ``"1.5 GiB"``; KiB/MiB/GiB/TiB
    are powers of 1024, KB/MB/GB/TB of 1000).

    Raises:
        ConfigError: not a size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().replace("_", "").replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
        unit = text[len(number):].lower()
        try:
            if unit in _UNITS and number:
                return int(float(number) * _UNITS[unit])
        except ValueError:
            pass
    raise ConfigError(f"{what}={value!r}: expected a size in bytes, e.g. 1073741824, \"1GiB\" or \"512MB\"")


def typed_value(what: str, value: Any, annotation: str, from_text: bool = False, field: str = "") -> Any:
    """``value`` checked against a field's annotation; ``from_text``: a text (an environment variable's, a
    flag's), converted. ``field`` names the field when ``what`` does not end with it (sizes take units).

    Raises:
        ConfigError: the value has another type, saying which was expected.
    """
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None and "None" in kinds:
        return None
    base = kinds[0]
    if (field or what.rsplit(".", 1)[-1]) in _SIZES:
        return parse_size(value, what)
    text = from_text and isinstance(value, str)
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if text and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
        elif base == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if text and value.strip().lstrip("-").isdigit():
                return int(value)
        elif base == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if text:
                return float(value)
        elif base == "str":
            if isinstance(value, str):
                return value
        else:
            return value
    except ValueError:
        pass
    raise ConfigError(f"{what}={value!r}: expected {' or '.join(kinds)}, got {type(value).__name__}")


def _check_types(s: ServerSettings) -> None:
    """Every setting, and every [cache] field, of the type its dataclass declares (sizes may carry units).

    Raises:
        ConfigError: a wrongly typed value, named with its key.
    """
    for f in dataclasses.fields(ServerSettings):
        if f.name in ("cache", "tables"):
            continue
        value = getattr(s, f.name)
        if str(f.type).startswith("list"):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{f.name}={value!r}: expected a list of file names")
            continue
        setattr(s, f.name, typed_value(f.name, value, str(f.type)))
    cache_types = {f.name: str(f.type) for f in dataclasses.fields(CacheConfig)}
    for key, value in list(s.cache.items()):
        if key in cache_types:
            s.cache[key] = typed_value(f"cache.{key}", value, cache_types[key])


def apply_environment(s: ServerSettings, environ: Mapping[str, str]) -> None:
    """``EMBCACHE_<SETTING>`` (e.g. EMBCACHE_METRICS_PORT) and ``EMBCACHE_<CACHE FIELD>`` (e.g. EMBCACHE_HBM_BYTES,
    EMBCACHE_PATH) override the config file; flags override them.

    Raises:
        ConfigError: a variable's text is not of its setting's type.
    """
    for f in dataclasses.fields(ServerSettings):
        key = f"EMBCACHE_{f.name.upper()}"
        if key in environ and f.name not in ("cache", "tables") and not str(f.type).startswith("list"):
            setattr(s, f.name, typed_value(key, environ[key], str(f.type), from_text=True, field=f.name))
    for f in dataclasses.fields(CacheConfig):
        key = f"EMBCACHE_{f.name.upper()}"
        if key in environ and not hasattr(s, f.name):
            s.cache[f.name] = typed_value(key, environ[key], str(f.type), from_text=True, field=f.name)


def check_settings(s: ServerSettings) -> None:
    """Type every setting (converting sizes with units) and check the values and their combinations.

    Raises:
        ConfigError: a wrongly typed or impossible value, or TLS half configured.
    """
    _check_types(s)
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    if s.tls_client_ca and not s.tls_cert:
        raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if s.max_message_bytes < 1 << 16:
        raise ConfigError(f"max_message_bytes={s.max_message_bytes}: must be at least 65536")
    if not 0 < float(s.stream_idle_seconds) < float("inf"):
        raise ConfigError(f"stream_idle_seconds={s.stream_idle_seconds}: must be a number of seconds > 0")
    if s.workers < 0 or s.stream_workers < 0:
        raise ConfigError(f"workers={s.workers}, stream_workers={s.stream_workers}: must be >= 0 (0: the default)")
    _check_serving(s)
    if not MIN_TTL_SECONDS <= float(s.max_lease_seconds) < float("inf"):
        raise ConfigError(f"max_lease_seconds={s.max_lease_seconds}: must be a number of seconds >= {MIN_TTL_SECONDS}")


def _check_serving(s: ServerSettings) -> None:
    """Serving mode's settings: a directory, and nothing that writes (tables, durability).

    Raises:
        ConfigError: a serving setting without ``serve``, or ``serve`` with a setting it excludes.
    """
    if not s.serve:
        if s.follow:
            raise ConfigError("--follow needs --serve DIR (the export directory to serve and follow)")
        return
    if s.tables:
        raise ConfigError(f"--serve takes its tables from the export in {s.serve!r}; drop --table/[[tables]] "
                          f"({', '.join(t.name for t in s.tables)})")
    if s.flush_every_updates or s.flush_interval_seconds or s.sync:
        raise ConfigError("--serve is read-only: --flush-every-updates, --flush-interval-seconds and --sync "
                          "do not apply")
    if s.unknown_rows not in ("zeros", "init"):
        raise ConfigError(f"unknown_rows={s.unknown_rows!r}: choose 'zeros' or 'init'")
    if not 0 < float(s.follow_interval_seconds) < float("inf"):
        raise ConfigError(f"follow_interval_seconds={s.follow_interval_seconds}: must be a number of seconds > 0")
    if "lookups_create_rows" in s.cache:
        raise ConfigError("--serve sets [cache] lookups_create_rows (to false) itself; drop it")
