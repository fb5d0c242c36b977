"""How the servicer's methods are registered with a gRPC server (:func:`add_to_server`).

The hot calls skip the generated classes: their requests arrive as bytes (parsed by
:mod:`embcache.rpc.wire` into views of those bytes) and the Lookup reply leaves as bytes. Every
other request is parsed by a deserializer that never raises: bytes that are no valid request
reach the handler as :class:`_Malformed`, which refuses them with INVALID_ARGUMENT
(InvalidKeysError, "malformed ..."), never gRPC's own INTERNAL. A request stream is checked the
same way, message by message, and its end is told apart from a cancellation (:func:`_checked`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from ..errors import InvalidKeysError
from ..rpc.errors import StreamCancelledError
from ..rpc.v1 import embcache_pb2 as pb
from .overload import on_pool

if TYPE_CHECKING:
    from .servicer import EmbeddingCacheServicer

__all__ = ["SERVICE_NAME", "Behavior", "add_to_server", "method_handler"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].full_name
_RAW_REQUESTS = frozenset({"Lookup", "ApplyGradients", "Assign"})
_RAW_RESPONSES = frozenset({"Lookup"})
_CANCEL_GRACE_SECONDS = 0.01  # how long a request stream's end waits to learn that it was a cancellation
_NAME_MAX, _PATH_MAX = 255, 4096  # Linux's limits on a file name and a path, in bytes

#: A method handler's function: ``behavior(request or request iterator, context)`` -> reply or reply iterator.
Behavior = Callable[[Any, grpc.ServicerContext], Any]

_HANDLER_FACTORIES = {(False, False): grpc.unary_unary_rpc_method_handler,
                      (False, True): grpc.unary_stream_rpc_method_handler,
                      (True, False): grpc.stream_unary_rpc_method_handler,
                      (True, True): grpc.stream_stream_rpc_method_handler}


def method_handler(request_streaming: bool, response_streaming: bool, behavior: Behavior,
                   request_deserializer: Callable[[bytes], Any] | None,
                   response_serializer: Callable[[Any], bytes] | None) -> grpc.RpcMethodHandler:
    """The gRPC method handler of ``behavior`` for a call of that kind (unary or streaming, either way)."""
    return _HANDLER_FACTORIES[(request_streaming, response_streaming)](
        behavior, request_deserializer=request_deserializer, response_serializer=response_serializer)


def _identity(data: bytes) -> bytes:
    return data


class _Malformed:
    """What a request deserializer hands the handler for bytes that are no valid request (it never raises).

    gRPC answers a deserializer's exception with INTERNAL ("Exception deserializing request!")
    and no metadata; the handler refuses this with INVALID_ARGUMENT and the error type instead.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _parser(request_type: Any) -> Callable[[bytes], Any]:
    """``request_type.FromString`` that returns a :class:`_Malformed` instead of raising."""
    name = request_type.DESCRIPTOR.name

    def parse(data: bytes) -> Any:
        try:
            request = request_type.FromString(data)
        except Exception as exc:  # DecodeError, or whatever else the parser raises on garbage
            return _Malformed(f"malformed {name}: {exc or 'not a valid protobuf message'}")
        problem = _checkpoint_problem(request.directory) if name == "CheckpointRequest" else None
        return _Malformed(f"malformed {name}: {problem}") if problem else request
    return parse


def _checkpoint_problem(directory: str) -> str | None:
    """Why ``directory`` can be no path on this system (the OS would refuse it with an OSError), or None."""
    if "\0" in directory:
        return "the directory name holds a NUL character"
    if len(directory.encode()) >= _PATH_MAX or any(len(p.encode()) > _NAME_MAX for p in directory.split("/")):
        return f"the directory name is longer than a path ({_PATH_MAX} bytes) or a name in it ({_NAME_MAX}) may be"
    return None


def _checked(requests: Iterator[Any], context: grpc.ServicerContext, method: str,
             on_message: Callable[[], None] = lambda: None) -> Iterator[Any]:
    """A request stream whose malformed message raises InvalidKeysError where the handler reads it,
    and whose end raises StreamCancelledError when the client cancelled it instead of closing it.
    ``on_message()`` runs for every message read (malformed ones too).

    gRPC ends the requests of a call the client cancelled (or whose deadline passed) mid-stream
    just as if the client had sent its last chunk, and learns of the cancellation a moment later:
    a handler that took that for the end applied the chunks it had (half of the cancelled streams
    in a test). So the end waits up to ``_CANCEL_GRACE_SECONDS`` for the call to turn inactive.
    """
    ended = threading.Event()
    context.add_callback(ended.set)  # runs when the call terminates (cancelled, or finished)
    for request in requests:
        on_message()
        if isinstance(request, _Malformed):
            raise InvalidKeysError(request.message)
        yield request
    ended.wait(_CANCEL_GRACE_SECONDS)
    if not context.is_active():
        raise StreamCancelledError(f"{method}: the client cancelled the stream (or its deadline passed) before "
                                   "it ended; nothing of it was applied")


def _guarded(servicer: EmbeddingCacheServicer, name: str, streaming: bool) -> Behavior:
    """The servicer's method ``name``, refusing a malformed request with INVALID_ARGUMENT before it runs
    (and with a request stream, cut when it idles: see :class:`~embcache.server.overload.StreamWatchdog`).

    Each call is counted as started here, and each message of a request stream as it is read;
    the servicer counts the call's end (every path through it ends in exactly one
    ``metrics.handled``: see :mod:`embcache.server.rpcmetrics`).
    """
    method = getattr(servicer, name)
    metrics = servicer.metrics
    if streaming:
        def received() -> None:
            metrics.received(name)

        def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            metrics.started(name)
            return method(_checked(servicer.watch(requests, context, name), context, name, received), context)
        return stream

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        metrics.started(name)
        if isinstance(request, _Malformed):
            servicer.refuse_malformed(name, context, request.message)
        return method(request, context)
    return unary


def add_to_server(servicer: EmbeddingCacheServicer, server: grpc.Server,
                  stream_pool: ThreadPoolExecutor | None = None) -> None:
    """Register the servicer, with bytes in and out for the hot calls (the generated helper would parse them).

    Every request deserializer returns instead of raising: bytes that are no valid request get
    INVALID_ARGUMENT (InvalidKeysError, "malformed ..."), never gRPC's own INTERNAL. With
    ``stream_pool``, the calls that stream (either way) run on it, not on the server's pool.
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        behavior = _guarded(servicer, method.name, method.client_streaming)
        if stream_pool is not None and (method.client_streaming or method.server_streaming):
            behavior = on_pool(behavior, stream_pool)
        handlers[method.name] = method_handler(
            method.client_streaming, method.server_streaming, behavior,
            request_deserializer=_identity if method.name in _RAW_REQUESTS else _parser(request_type),
            response_serializer=_identity if method.name in _RAW_RESPONSES else response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
