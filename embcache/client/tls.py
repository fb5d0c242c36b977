"""TLS for the client: how it dials (:class:`TLSSettings`), and what is wrong when a channel does not come up.

A gRPC channel whose TLS handshake fails never becomes ready, and says nothing about why; a
call waiting for it only times out. :func:`tls_problem` asks the server with Python's own
handshakes instead and says in words what does not match (plaintext against TLS, a
certificate that does not verify, a missing client certificate); :meth:`TLSSettings.check_ready`
runs it for the shards whose channels are not ready soon after the client is made.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from ..rpc.errors import TLSMismatchError

__all__ = ["TLSSettings", "read_pem", "tls_problem"]


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``[v6]:port`` address; None for other target forms."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    return host.strip("[]"), int(port)


def _handshake(address: tuple[str, int], context: ssl.SSLContext, server_name: str | None,
               timeout: float) -> tuple[str, str]:
    """A TLS handshake with ``address``: ``(outcome, detail)``, outcome one of "ok", "alert" (a TLS peer
    refused it), "verify" (its certificate failed the check), "plain" (no TLS answer), "unreachable"."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        return "unreachable", str(exc)
    try:
        with context.wrap_socket(sock, server_hostname=server_name) as tls:
            if context.verify_mode == ssl.CERT_REQUIRED:  # TLS 1.3 reports a missing client certificate now
                tls.settimeout(min(timeout, 0.5))
                try:
                    if not tls.recv(1):
                        return "alert", "the server closed the connection after the handshake"
                except ssl.SSLError as exc:
                    return "alert", exc.reason or str(exc)
                except OSError:  # nothing to read: the server waits for the client, as it should
                    pass
            return "ok", ""
    except ssl.SSLCertVerificationError as exc:
        return "verify", exc.verify_message or str(exc)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        return ("alert" if "ALERT" in reason.upper() else "plain"), reason
    except TimeoutError:  # no answer at all (a stalled server): nothing to say about TLS
        return "unreachable", "no answer"
    except OSError as exc:  # closed or reset on the first bytes of a ClientHello: not a TLS server
        return "plain", str(exc)
    finally:
        sock.close()


def tls_problem(address: str, tls: bool, ca: bytes | None = None, server_name: str | None = None,
                has_client_cert: bool = False, timeout: float = 2.0) -> str | None:
    """What is wrong with TLS between this client and the server at ``address``, in words; None if nothing.

    Made with Python's own TLS handshakes to the address, so it tells a plaintext server from a
    TLS one, a certificate that does not verify against ``ca`` (or name ``server_name``), and a
    server that wants a client certificate. None too when the server cannot be reached at all.

    Args:
        address: ``host:port``.
        tls: whether the client dials with TLS.
        ca: the PEM the client verifies servers with (TLS only).
        server_name: the name the certificate must carry (default: the host).
        has_client_cert: whether the client presents a certificate (mutual TLS).
    """
    where = _host_port(address)
    if where is None:
        return None
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    probe.set_alpn_protocols(["h2"])
    outcome, detail = _handshake(where, probe, None, timeout)
    if outcome == "unreachable":
        return None
    speaks_tls = outcome in ("ok", "alert")
    if not tls:
        return (f"the server at {address} speaks TLS and this client plaintext: pass tls_ca (with tls_cert and "
                f"tls_key for mutual TLS)") if speaks_tls else None
    if not speaks_tls:
        return (f"this client speaks TLS and the server at {address} does not (plaintext: {detail}); leave out "
                f"tls_ca/tls_cert, or start the server with --tls-cert/--tls-key")
    if ca is None:
        return None
    verify = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    verify.set_alpn_protocols(["h2"])
    try:
        verify.load_verify_locations(cadata=ca.decode(errors="replace"))
    except (ssl.SSLError, ValueError):
        return f"tls_ca holds no usable PEM certificate, so the server at {address} cannot be verified"
    outcome, detail = _handshake(where, verify, server_name or where[0], timeout)
    if outcome == "verify":
        return (f"TLS handshake with {address} failed: the server's certificate does not verify against tls_ca "
                f"for the name {server_name or where[0]!r} ({detail}); check tls_ca, or pass tls_server_name")
    if outcome == "alert" and not has_client_cert:
        return (f"TLS handshake with {address} failed: the server wants a client certificate (mutual TLS; "
                f"{detail}): pass tls_cert and tls_key")
    if outcome == "alert":
        return f"TLS handshake with {address} failed: the server refused it ({detail}); check tls_cert and tls_key"
    return None


def read_pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes as given, or read from the file path given; None stays None."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class TLSSettings:
    """How the client dials its shards: TLS (``credentials`` set) or plaintext.

    Attributes:
        credentials: the channel credentials (None: plaintext).
        ca: the PEM of the CA the client verifies servers with.
        server_name: the name server certificates must carry, when it is not the host.
        has_client_cert: the client presents a certificate (mutual TLS).
    """

    credentials: grpc.ChannelCredentials | None = None
    ca: bytes | None = None
    server_name: str | None = None
    has_client_cert: bool = False

    @classmethod
    def of(cls, ca: str | bytes | None, cert: str | bytes | None, key: str | bytes | None,
           server_name: str | None) -> TLSSettings:
        """The settings of the Client arguments ``tls_ca``, ``tls_cert``, ``tls_key`` (PEM bytes or file
        paths) and ``tls_server_name``: TLS when ``ca`` or ``cert`` is given."""
        ca_pem = read_pem(ca)
        credentials = None
        if ca is not None or cert is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=read_pem(key),
                                                       certificate_chain=read_pem(cert))
        return cls(credentials, ca_pem, server_name, cert is not None)

    @property
    def channel_options(self) -> list[tuple[str, str | int]]:
        """The channel options these settings add (the name to check certificates against)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.credentials and self.server_name else []

    def problem(self, address: str) -> str | None:
        """:func:`tls_problem` for the server at ``address`` with these settings."""
        return tls_problem(address, self.credentials is not None, self.ca, self.server_name, self.has_client_cert)

    def check_ready(self, channels: Sequence[tuple[str, grpc.Channel]], wait: float) -> None:
        """Raise TLSMismatchError for a channel (``(address, channel)``) not ready after ``wait`` s because of TLS.

        A channel whose TLS handshake fails never becomes ready, and a call waiting for it (the
        default ``wait_for_ready``) would only time out: a shard not ready this soon is asked
        with Python's own handshakes what is wrong (:func:`tls_problem`), which also says
        nothing for a shard that is only down or starting (the calls then wait as before).
        """
        futures = [(address, grpc.channel_ready_future(channel)) for address, channel in channels]
        end = time.monotonic() + wait
        try:
            for address, ready in futures:
                try:
                    ready.result(timeout=max(end - time.monotonic(), 0.0))
                except grpc.FutureTimeoutError:
                    problem = self.problem(address)
                    if problem is not None:
                        raise TLSMismatchError(problem, grpc.StatusCode.UNAVAILABLE, address) from None
        finally:
            for _, ready in futures:
                ready.cancel()
