"""Finding the shards behind a DNS name (``"dns:///name:port"``, e.g. a Kubernetes headless Service).

:func:`resolve_shards` names every address the name resolves to by its reverse-DNS name (a
StatefulSet pod's stable name, so a shard keeps its place on the hash ring when its pod comes
back with another IP); :func:`resolve_expected` resolves again until the name gives as many
shards as expected.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from ..rpc.errors import UnavailableError

__all__ = ["Resolver", "resolve_expected", "resolve_shards"]


class Resolver(Protocol):
    """A name resolver with the shape of :func:`socket.getaddrinfo`, as the client calls it:
    ``resolver(host, port, type=socket.SOCK_STREAM)`` -> ``[(family, type, proto, canonname, sockaddr), ...]``."""

    def __call__(self, host: str, port: int, *, type: int) -> Sequence[tuple[Any, ...]]:
        ...


def resolve_shards(target: str, resolver: Resolver = socket.getaddrinfo) -> dict[str, str]:
    """The shards behind a DNS name, e.g. a Kubernetes headless Service: ``{shard name: "host:port"}``.

    Args:
        target: ``"dns:///name:port"`` (or ``"name:port"``). Every address the name resolves to
            is a shard, named by its reverse-DNS name: for a StatefulSet behind a headless
            Service that is the pod's stable ``embcache-0.embcache.<ns>.svc.cluster.local``, so
            a shard keeps its place on the hash ring when its pod comes back with another IP.
            An address without a reverse name is named by its IP; addresses that would share a
            name (several ports of one host) are named by their ``ip:port``.
        resolver: a callable with the shape of :func:`socket.getaddrinfo` (the default), called
            as ``resolver(host, port, type=socket.SOCK_STREAM)``; each result's sockaddr gives the
            address (its port too, so a resolver may return SRV-style ports).

    Raises:
        ValueError: no port, or the name does not resolve.
    """
    hostport = target.removeprefix("dns:///")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected 'dns:///name:port', got {target!r}")
    try:
        infos = resolver(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{host!r} does not resolve: {exc}") from None
    if not infos:
        raise ValueError(f"{host!r} does not resolve: no addresses")
    named: list[tuple[str, str]] = []
    for ip, p in sorted({(str(info[4][0]), int(info[4][1])) for info in infos}):
        try:
            name = socket.gethostbyaddr(ip)[0]
        except OSError:
            name = ip
        named.append((name, f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}"))
    counts = {n: sum(1 for m, _ in named if m == n) for n, _ in named}
    return {name if counts[name] == 1 else address: address for name, address in named}


def resolve_expected(target: str, resolver: Resolver, expected: int | None, deadline: float) -> dict[str, str]:
    """:func:`resolve_shards`, again every 0.2 s until it gives ``expected`` addresses (None: any number).

    Raises:
        UnavailableError: the name does not give ``expected`` addresses by ``deadline`` (monotonic
            time; one try when it has passed).
        ValueError: as :func:`resolve_shards`.
    """
    while True:
        shards = resolve_shards(target, resolver)
        if expected is None or len(shards) == expected:
            return shards
        if time.monotonic() + 0.2 >= deadline:
            raise UnavailableError(f"{target} resolves to {len(shards)} addresses ({sorted(shards.values())}), "
                                   f"expected {expected}", grpc.StatusCode.UNAVAILABLE)
        time.sleep(0.2)
