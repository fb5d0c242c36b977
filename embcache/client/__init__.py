"""embcache.Client: the methods of EmbeddingCache, served by one embcache-server or a fleet of shards.

    from embcache import Client
    with Client(["10.0.0.1:50051", "10.0.0.2:50051"], timeout=30) as cache:
        rows = cache.lookup("user", keys)               # float32 [n, dim] on the CPU
        cache.apply_gradients("user", keys, grads)

Keys are spread over the shards by a consistent hash (a 64-bit mix of the key placed on a ring
of virtual nodes per shard: adding a shard moves about 1/N of the keys). A call sends one
request per shard carrying every table (``lookup_many`` and ``apply_gradients_many`` cost one
round trip per step), all shards in parallel. Batches beyond the message size limit are split:
lookups into several requests; writes, and the keysets of ``prefetch``, ``begin_pass`` and
``prefetch_batch``, into a client stream that the server merges and serves as one request (atomic
per table and shard).

Batch leases (``prefetch_batch``, and so :class:`~embcache.LookAhead` over a client): each shard
holds its part of a lease by id with a time-to-live (``lease_ttl``, default 30 s), which one
background thread of this client renews (one call per shard for all leases, every third of the
TTL, or a bounded wait while staging runs). ``release()`` and ``cancel()`` unpin at once; if this
process dies, the servers unpin the rows when the TTL runs out (see ``embcache.server.leases`` for
why a TTL rather than a call held per lease).

Deadlines: every call has one (``timeout``, or ``long_timeout`` for passes, flush and
checkpoint); by default a call waits for a shard that is down or restarting until its deadline
(``wait_for_ready``), which never sends a request twice. Retries: a call that fails with
UNAVAILABLE (or CANCELLED by a server stopping as it arrived) is retried with exponential backoff,
within its deadline, only when it is idempotent: ``lookup`` (idempotent for the values it returns,
though the retried attempt counts its accesses again in the server's statistics and placement),
``tables``, ``create_table``, ``flush``, ``stats``, ``resident_keys``, and the release and renewal
of leases. Writes (``apply_gradients``, ``assign``), checkpoints, pass calls (``prefetch``,
``begin_pass``, ``end_pass``) and ``prefetch_batch`` are never resent, unless the server said it
refused them before they had any effect (UNAVAILABLE with ``embcache-not-applied: 1``: a server
draining at shutdown); then they are resent like the idempotent calls. Only the failed shards'
calls are resent; each resend is logged (logger ``embcache.client``, INFO).

Restarts: every write reply carries a receipt (the server process's random incarnation and the
write's number there); :meth:`Client.flush` and :meth:`Client.checkpoint` settle the receipts
held since the last flush and raise :class:`DataLossError` when a shard's restart lost writes it
had acknowledged (:mod:`embcache.receipts`); a pass or staging lease dropped by a restart raises
:class:`ShardRestartedError`.

Shards from DNS (``"dns:///name:port"``) are resolved when the client is made; ``expected_shards``
makes it wait until the name gives that many, and :meth:`Client.refresh_shards` resolves again.

Errors: the server's typed errors come back as the same :mod:`embcache.errors` types; failures
without one are :class:`~embcache.rpc.errors.RemoteError` subclasses (UnavailableError,
DeadlineExceededError, UnauthenticatedError, PermissionDeniedError). Input that is wrong
whatever the server (key dtype, gradient shape, NaN) is refused here before anything is sent,
so a multi-shard write never half-applies bad input; a shard failing for another reason (down,
disk full) can leave the other shards' part applied.

The package's rooms: :mod:`~embcache.client.api` (the :class:`Client` surface),
:mod:`~embcache.client.transport` (channels, calls, deadlines, resends, rerouting),
:mod:`~embcache.client.routing` (keyed batches split by shard, chunked, filled back),
:mod:`~embcache.client.passes` (the pass protocol), :mod:`~embcache.client.leases` (batch
leases and their keeper thread), :mod:`~embcache.client.durability` (flush and checkpoint,
settling write receipts), :mod:`~embcache.client.merge` (the shards' answers as one),
:mod:`~embcache.client.tls` (TLS settings and mismatch diagnosis) and
:mod:`~embcache.client.discovery` (shards from DNS).
"""

from ..ring import HashRing
from ..rpc.errors import (
    DataLossError,
    DeadlineExceededError,
    PermissionDeniedError,
    RemoteError,
    ShardRestartedError,
    TLSMismatchError,
    UnauthenticatedError,
    UnavailableError,
)
from .api import Client
from .discovery import Resolver, resolve_shards
from .leases import RemoteLease
from .merge import merge_stats as _merge_stats  # (the name tests import)
from .tls import tls_problem
from .transport import RemoteFuture

__all__ = [
    "Client",
    "DataLossError",
    "DeadlineExceededError",
    "HashRing",
    "PermissionDeniedError",
    "RemoteError",
    "RemoteFuture",
    "RemoteLease",
    "Resolver",
    "ShardRestartedError",
    "TLSMismatchError",
    "UnauthenticatedError",
    "UnavailableError",
    "_merge_stats",
    "resolve_shards",
    "tls_problem",
]
