"""The hot messages (Lookup, ApplyGradients, Assign) encoded and parsed by hand, without copies.

The generated protobuf classes copy a tensor's bytes three times on the way out (``tobytes``,
into the message, into the serialized buffer) and twice on the way in; for a batch of
8,192 x 64 floats that is half a millisecond per call, a third of what a raw gRPC echo of the
same bytes costs. Here a message is written as a list of small headers and the tensor's own
memory, joined once, and parsed into views (:class:`RawTensor` holds a ``memoryview`` of the
received bytes). A Lookup reply is not even joined: the server allocates it once
(:func:`new_lookup_response`) and the cache writes the rows straight into it; the client hands
the rows to its caller in place (:func:`as_tensor`). For that, each tensor's data starts at a
16-byte aligned offset, behind a ``padding`` field (Tensor field 15) that receivers ignore.

The encoding is standard protobuf (``proto/embcache/rpc/v1/embcache.proto``): any client or
server using the generated classes, or grpcurl, reads and writes the same bytes, and the parser
accepts every valid encoding (fields in any order, unknown fields, packed or unpacked shapes).

Parsing never trusts the input: a truncated or malformed message raises InvalidKeysError
("malformed ...") and tensor sizes are checked by :func:`embcache.rpc.codec.decode_tensor`.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidKeysError

__all__ = [
    "RawTensor",
    "TableKeysView",
    "TableValuesView",
    "as_tensor",
    "encode_lookup_request",
    "encode_lookup_response",
    "encode_values_request",
    "new_lookup_response",
    "parse_lookup_request",
    "parse_lookup_response",
    "parse_values_request",
    "payload_budget",
]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_DTYPE_NAMES = {np.dtype("<i8"): b"int64", np.dtype("<i4"): b"int32", np.dtype("<f4"): b"float32",
                np.dtype("<f2"): b"float16", np.dtype("<f8"): b"float64"}


# ---------------------------------------------------------------------- encoding
_ALIGN = 16  # tensor data starts at a multiple of this offset in the message (see _layout)
_PAD_KEY = bytes([15 << 3 | _LEN])  # Tensor.padding (field 15): zeros written before data to align it
_MESSAGE_MARGIN = 1 << 16  # bytes kept free in each message for framing, table names and options


def payload_budget(max_message: int) -> int:
    """Bytes of tensor data (keys, rows, counts) one message of at most ``max_message`` bytes may carry."""
    return max(max_message - _MESSAGE_MARGIN, 1 << 15)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field_no: int, wire_type: int) -> bytes:
    return _varint(field_no << 3 | wire_type)


@dataclass(frozen=True)
class _Spec:
    """What a Tensor message holds: wire dtype name, shape, byte length of data."""

    dtype: bytes
    shape: tuple[int, ...]
    nbytes: int


def _spec(arr: np.ndarray) -> tuple[_Spec, np.ndarray]:
    """The spec of a C-contiguous little-endian array, and that array (converted if needed)."""
    arr = np.ascontiguousarray(arr)
    wire = arr.dtype.newbyteorder("<")
    name = _DTYPE_NAMES.get(wire)
    if name is None:
        raise TypeError(f"dtype {arr.dtype} has no wire form")
    if arr.dtype != wire:
        arr = arr.astype(wire)
    return _Spec(name, tuple(int(s) for s in arr.shape), arr.nbytes), arr


def _layout(entries: Sequence[tuple[str, Sequence[_Spec]]]) -> tuple[tuple[bytes, ...], tuple[int, ...], int]:
    """The headers of a message whose field 1 repeats ``{1: table, 2: Tensor, 3: Tensor, ...}`` entries.

    The message is ``heads[0] + data[0] + heads[1] + data[1] + ...``, one head per tensor: each
    tensor's data is its message's last field and each entry's tensors are its last fields, so
    everything between two tensors' data is one head. A ``padding`` field (15) in a Tensor,
    before its data, makes every data offset a multiple of ``_ALIGN``: the receiver views rows
    and gradients in place with their natural alignment (gRPC's buffers are 16-byte aligned).

    Returns:
        ``(heads, data offsets, total size)``.

    Raises:
        ValueError: an entry has no tensor.
    """
    return _layout_of(tuple((t, tuple(specs)) for t, specs in entries))


def _vlen(n: int) -> int:
    """Bytes of the varint of ``n``."""
    return max(1, (n.bit_length() + 6) // 7)


@functools.lru_cache(maxsize=256)  # a training loop sends the same shapes again and again
def _layout_of(entries: tuple[tuple[str, tuple[_Spec, ...]], ...]) -> tuple[tuple[bytes, ...], tuple[int, ...], int]:
    if any(not specs for _, specs in entries):
        raise ValueError("every table entry needs a tensor")
    names = [_key(1, _LEN) + _varint(len(t.encode())) + t.encode() for t, _ in entries]
    tensors = []  # (entry, field key, dtype and shape fields, data key and length, data bytes)
    for i, (_, specs) in enumerate(entries):
        for j, spec in enumerate(specs):
            shape = b"".join(_varint(s) for s in spec.shape)
            tensors.append((i, _key(2 + j, _LEN), _key(1, _LEN) + _varint(len(spec.dtype)) + spec.dtype + _key(2, _LEN)
                            + _varint(len(shape)) + shape, _key(3, _LEN) + _varint(spec.nbytes), spec.nbytes))

    def place(pads: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Tensor message sizes without data, entry sizes and data offsets for these padding field sizes."""
        bodies = [len(a) + pad + len(b) for (_, _, a, b, _), pad in zip(tensors, pads, strict=True)]
        sizes = [len(name) for name in names]
        for (i, key, _, _, n), body in zip(tensors, bodies, strict=True):
            sizes[i] += len(key) + _vlen(body + n) + body + n
        offsets, pos, opened = [], 0, -1
        for (i, key, _, _, n), body in zip(tensors, bodies, strict=True):
            if i != opened:
                pos += 1 + _vlen(sizes[i]) + len(names[i])
                opened = i
            pos += len(key) + _vlen(body + n) + body
            offsets.append(pos)
            pos += n
        return bodies, sizes, offsets

    def aligned(offsets: list[int], upto: int) -> bool:
        return all(not tensors[m][4] or offsets[m] % _ALIGN == 0 for m in range(upto + 1))

    # Tensor k's data offset depends on the paddings of tensors <= k, and on its entry's length
    # varint, which precedes them all. First keep every entry's varint width fixed: an entry that
    # paddings could lengthen past a width boundary is padded past it now. Then, tensor by tensor,
    # the smallest padding field (0, or key + length + zeros) that aligns it cannot move the ones
    # before it.
    pads = [0] * len(tensors)
    floor = [0] * len(tensors)
    firsts: dict[int, int] = {}
    for k, t in enumerate(tensors):
        firsts.setdefault(t[0], k)
    for i, size in enumerate(place(pads)[1]):
        boundary = 128 ** _vlen(size)
        slack = (2 * _ALIGN + 4) * sum(1 for t in tensors if t[0] == i)
        if size + slack >= boundary:
            floor[firsts[i]] = pads[firsts[i]] = max(2, boundary - size + 2)
    for k in range(len(tensors)):
        offsets = place(pads)[2]
        if aligned(offsets, k):
            continue
        offset = offsets[k]
        low = floor[k]
        guess = pads[k] + (_ALIGN - offset % _ALIGN)  # right unless the tensor's length varint grows too
        if guess == 1:
            guess += _ALIGN
        scan = (0, *range(2, 4 + 2 * _ALIGN)) if low == 0 else range(low, low + 2 * _ALIGN + 2)
        for candidate in (guess, guess + _ALIGN - 1, *scan):
            if candidate == 1 or candidate < low or candidate > 129:  # at most 127 zeros: a 1-byte length
                continue
            trial = [*pads[:k], candidate, *pads[k + 1:]]
            if aligned(place(trial)[2], k):
                pads = trial
                break
        else:  # not seen in practice: the rest stays unaligned (still a valid message; receivers copy)
            break
    bodies, sizes, offsets = place(pads)
    heads, opened = [], -1
    for (i, key, a, b, n), pad, body in zip(tensors, pads, bodies, strict=True):
        head = key + _varint(body + n) + a + (_PAD_KEY + _varint(pad - 2) + bytes(pad - 2) if pad else b"") + b
        if i != opened:  # the entry opens with its key, its length and the table name
            head = _key(1, _LEN) + _varint(sizes[i]) + names[i] + head
            opened = i
        heads.append(head)
    total = sum(len(h) for h in heads) + sum(t[4] for t in tensors)
    return tuple(heads), tuple(offsets), total


def _repeated_tables(entries: Sequence[tuple[str, Sequence[np.ndarray]]]) -> bytes:
    """A message whose field 1 repeats table entries, joined once from the arrays' own memory."""
    specs: list[tuple[str, list[_Spec]]] = []
    arrays: list[np.ndarray] = []
    for table, tensors in entries:
        row = []
        for arr in tensors:
            spec, arr = _spec(arr)
            row.append(spec)
            arrays.append(arr)
        specs.append((table, row))
    heads, _, _ = _layout(specs)
    parts: list[bytes | memoryview] = []
    for k, head in enumerate(heads):
        parts.append(head)
        if k < len(arrays) and arrays[k].size:
            parts.append(memoryview(arrays[k]).cast("B"))  # type: ignore[arg-type]
    return b"".join(parts)


def encode_lookup_request(tables: Sequence[tuple[str, np.ndarray]]) -> bytes:
    """A LookupRequest: ``[(table, keys int64 [n])]``."""
    return _repeated_tables([(t, (k,)) for t, k in tables])


def encode_lookup_response(tables: Sequence[tuple[str, np.ndarray]]) -> bytes:
    """A LookupResponse: ``[(table, rows float32 [n, dim])]`` (the rows' memory is read once, into the result)."""
    return _repeated_tables([(t, (r,)) for t, r in tables])


def encode_values_request(tables: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> bytes:
    """An ApplyGradientsRequest or AssignRequest: ``[(table, keys [n], values [n, dim])]``."""
    return _repeated_tables([(t, (k, v)) for t, k, v in tables])


_F32 = _Spec(b"float32", (), 0)


def new_lookup_response(tables: Sequence[tuple[str, int, int]]) -> tuple[bytes, list[torch.Tensor]]:
    """A LookupResponse to fill in place: its bytes, and a float32 [n, dim] tensor over each table's rows in them.

    The reply is allocated once and the rows are written straight into it (by
    ``EmbeddingCache.lookup(..., out=view)``), so no copy of the rows is made to encode it. The
    bytes are complete once every view has been written; until then the row data is undefined.

    Args:
        tables: ``[(table, n, dim)]``.
    """
    specs = [(t, [_Spec(_F32.dtype, (n, dim), 4 * n * dim)]) for t, n, dim in tables]
    heads, offsets, total = _layout(specs)
    reply, address = _new_bytes(total)
    pos = 0
    views = []
    for k, head in enumerate(heads):
        _write(reply, address, pos, head)
        pos += len(head)
        if k < len(tables):
            _, n, dim = tables[k]
            views.append(_tensor_at(reply, address + offsets[k], (n, dim), torch.float32))
            pos += 4 * n * dim
    return reply, views


def as_tensor(owner: bytes | memoryview, arr: np.ndarray) -> torch.Tensor:
    """A writable tensor over ``arr``, a read-only view of the received message ``owner`` (no copy).

    The message is a ``bytes`` object that only this tensor (and ``arr``) refer to, so the rows
    can be handed to the caller in place, as a tensor from ``torch.empty`` would be; the tensor
    keeps ``owner`` alive. Where the data is not aligned to its dtype (a sender that does not
    pad), or the array is already a private copy, it is copied or used as it is.
    """
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    address = arr.__array_interface__["data"][0]
    if address % arr.dtype.itemsize or not arr.size:
        return torch.from_numpy(arr.copy())
    return _tensor_at(owner, address, arr.shape, _TORCH_DTYPES[arr.dtype.str])


_TORCH_DTYPES = {"<f4": torch.float32, "<f2": torch.float16, "<f8": torch.float64, "<i8": torch.int64,
                 "<i4": torch.int32}
_bytes_new = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_new.restype = ctypes.py_object
_bytes_new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _new_bytes(size: int) -> tuple[bytes, int]:
    """An uninitialized ``bytes`` of ``size`` and its address: C's ``PyBytes_FromStringAndSize(NULL, size)``.

    As in C, its contents are written before anyone else sees it.
    """
    if size == 0:
        return b"", 0
    reply: bytes = _bytes_new(None, size)
    address = ctypes.cast(ctypes.c_char_p(reply), ctypes.c_void_p).value
    assert address is not None
    return reply, address


def _write(reply: bytes, address: int, offset: int, data: bytes) -> None:
    ctypes.memmove(address + offset, data, len(data))


def _tensor_at(owner: object, address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``prod(shape)`` elements at ``address`` inside ``owner``, which it keeps alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = (ctypes.c_char * nbytes).from_address(address)
    buf._owner = owner  # type: ignore[attr-defined]  # the tensor holds buf, buf holds the message
    return torch.frombuffer(buf, dtype=dtype).view(shape)


# ---------------------------------------------------------------------- parsing
@dataclass
class RawTensor:
    """A Tensor message's fields; ``data`` is a view of the received bytes (duck-types ``pb.Tensor``)."""

    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    data: memoryview = field(default_factory=lambda: memoryview(b""))


@dataclass
class TableKeysView:
    """TableKeys / TableRows / TableValues parsed: ``table`` and up to two tensors (duck-types the pb classes)."""

    table: str = ""
    tensors: dict[int, RawTensor] = field(default_factory=dict)

    @property
    def keys(self) -> RawTensor:
        """Field 2 (TableKeys, TableValues)."""
        return self.tensors.get(2, RawTensor())

    @property
    def rows(self) -> RawTensor:
        """Field 2 (TableRows)."""
        return self.tensors.get(2, RawTensor())

    @property
    def values(self) -> RawTensor:
        """Field 3 (TableValues)."""
        return self.tensors.get(3, RawTensor())

    def HasField(self, name: str) -> bool:  # the protobuf method's name, so views and messages mix
        """Whether the tensor field ``name`` was present."""
        return {"keys": 2, "rows": 2, "values": 3}[name] in self.tensors


TableValuesView = TableKeysView


def _fields(buf: memoryview, what: str) -> list[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of a message; LEN values are views."""
    out: list[tuple[int, int, int | memoryview]] = []
    pos, end = 0, buf.nbytes
    while pos < end:
        key, pos = _read_varint(buf, pos, what)
        field_no, wire_type = key >> 3, key & 7
        if field_no == 0:
            raise InvalidKeysError(f"malformed {what}: field number 0")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, what)
            out.append((field_no, wire_type, value))
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, what)
            if pos + length > end:
                raise InvalidKeysError(f"malformed {what}: a field of {length} bytes runs past the end")
            out.append((field_no, wire_type, buf[pos:pos + length]))
            pos += length
        elif wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
            if pos > end:
                raise InvalidKeysError(f"malformed {what}: truncated fixed-width field")
        else:
            raise InvalidKeysError(f"malformed {what}: wire type {wire_type} is not supported")
    return out


def _read_varint(buf: memoryview, pos: int, what: str) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= buf.nbytes or shift > 63:
            raise InvalidKeysError(f"malformed {what}: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _text(value: int | memoryview, what: str) -> str:
    if not isinstance(value, memoryview):
        raise InvalidKeysError(f"malformed {what}: a string field is not length-delimited")
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise InvalidKeysError(f"malformed {what}: a string field is not UTF-8") from None


def _tensor(buf: memoryview, what: str) -> RawTensor:
    t = RawTensor()
    for no, wt, value in _fields(buf, what):
        if no == 1:
            t.dtype = _text(value, what)
        elif no == 2 and wt == _VARINT:  # unpacked repeated int64
            t.shape.append(_signed(int(value)))
        elif no == 2 and isinstance(value, memoryview):  # packed
            pos = 0
            while pos < value.nbytes:
                v, pos = _read_varint(value, pos, what)
                t.shape.append(_signed(v))
        elif no == 3 and isinstance(value, memoryview):
            t.data = value
    return t


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _table_entries(data: bytes | memoryview, what: str) -> list[TableKeysView]:
    buf = data if isinstance(data, memoryview) else memoryview(data)
    entries = []
    for no, _, value in _fields(buf, what):
        if no != 1:
            continue
        if not isinstance(value, memoryview):
            raise InvalidKeysError(f"malformed {what}: a table entry is not length-delimited")
        entry = TableKeysView()
        for eno, _, evalue in _fields(value, what):
            if eno == 1:
                entry.table = _text(evalue, what)
            elif eno in (2, 3):
                if not isinstance(evalue, memoryview):
                    raise InvalidKeysError(f"malformed {what}: a tensor is not length-delimited")
                entry.tensors[eno] = _tensor(evalue, what)
        entries.append(entry)
    return entries


def parse_lookup_request(data: bytes | memoryview) -> list[TableKeysView]:
    """The table entries of a LookupRequest (``.table``, ``.keys``).

    Raises:
        InvalidKeysError: the bytes are not a valid message.
    """
    return _table_entries(data, "LookupRequest")


def parse_values_request(data: bytes | memoryview) -> list[TableKeysView]:
    """The table entries of an ApplyGradientsRequest or AssignRequest (``.table``, ``.keys``, ``.values``).

    Raises:
        InvalidKeysError: the bytes are not a valid message.
    """
    return _table_entries(data, "request")


def parse_lookup_response(data: bytes | memoryview) -> list[TableKeysView]:
    """The table entries of a LookupResponse (``.table``, ``.rows``).

    Raises:
        InvalidKeysError: the bytes are not a valid message.
    """
    return _table_entries(data, "LookupResponse")
