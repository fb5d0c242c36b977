"""The wire codec, the error table, the hash ring and the generated stubs (no network)."""

from __future__ import annotations

import importlib.util
import itertools
import math

import grpc
import numpy as np
import pytest
import torch

from embcache import Keyset, TableConfig
from embcache.client import HashRing, _merge_stats
from embcache.errors import (
    BatchTooLargeError,
    CacheClosedError,
    ConfigError,
    InvalidGradientError,
    InvalidKeysError,
    NonFiniteGradientError,
    PassStateError,
    StoreError,
    StoreFullError,
    TableConflictError,
    UnknownTableError,
)
from embcache.ring import ring_hash
from embcache.rpc import codec, wire
from embcache.rpc.errors import (
    ERROR_TYPE_KEY,
    NOT_APPLIED_KEY,
    PermissionDeniedError,
    RemoteError,
    UnauthenticatedError,
    UnavailableError,
    error_from_name,
    error_from_rpc,
    not_applied,
    status_of,
)
from embcache.rpc.v1 import embcache_pb2 as pb


# ---------------------------------------------------------------------- tensors
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float16, torch.float64])
def test_tensor_round_trip_is_bitwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(7, 5, generator=g) * 1000).to(dtype)
    msg = pb.Tensor.FromString(codec.encode_tensor(t).SerializeToString())
    assert list(msg.shape) == [7, 5]
    back = codec.decode_tensor(msg, "x", InvalidKeysError, list(codec._WIRE), 2)
    assert torch.equal(torch.from_numpy(back.copy()), t)


def test_tensor_bytes_are_little_endian_row_major() -> None:
    msg = codec.encode_tensor(np.array([[1, 2], [3, 258]], dtype=np.int64))
    assert msg.dtype == "int64"
    assert msg.data[:8] == (1).to_bytes(8, "little")
    assert msg.data[24:] == (258).to_bytes(8, "little")
    big = np.array([5, 6], dtype=">i8")  # a big-endian array is swapped to the wire order
    assert codec.encode_tensor(big).data == np.array([5, 6], dtype="<i8").tobytes()


def test_bfloat16_travels_as_float32() -> None:
    t = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    msg = codec.encode_tensor(t)
    assert msg.dtype == "float32"
    assert codec.decode_tensor(msg, "x", InvalidGradientError, codec.FLOAT_DTYPES, 2).tolist() == [[1.5, -2.0]]


def test_unsupported_dtype_is_refused_on_encode() -> None:
    with pytest.raises(TypeError, match="no wire form"):
        codec.encode_tensor(np.array([1, 2], dtype=np.uint8))


@pytest.mark.parametrize("mutate, match", [
    (lambda m: setattr(m, "dtype", "float32"), "dtype 'float32' is not allowed"),
    (lambda m: setattr(m, "dtype", "int8"), "dtype 'int8' is not allowed"),
    (lambda m: m.shape.append(1), "must have 1 dimension"),
    (lambda m: setattr(m, "data", m.data[:-1]), "23 bytes do not hold int64 \\[3\\]"),
    (lambda m: setattr(m, "data", m.data + b"\0" * 8), "32 bytes do not hold"),
    (lambda m: m.shape.__setitem__(0, -3), "negative dimension"),
    (lambda m: m.shape.__setitem__(0, 1000), "bytes do not hold"),
    (lambda m: m.shape.__setitem__(0, 2**40), "impossible"),
    (lambda m: m.shape.__setitem__(0, 2**63 - 1), "impossible"),
])
def test_malformed_keys_raise_before_frombuffer(mutate, match) -> None:
    msg = codec.encode_tensor(np.array([1, 2, 3], dtype=np.int64))
    mutate(msg)
    with pytest.raises(InvalidKeysError, match=match):
        codec.decode_keys(msg, "keys")


@pytest.mark.parametrize("shape", [[0, 2**62], [2**62, 0], [0, 2**31], [0, -1], [-(2**63), 0]])
def test_impossible_shapes_of_empty_tensors_are_invalid(shape: list[int]) -> None:
    """A zero dimension makes the byte count 0 whatever the others say: they are checked on their own."""
    msg = pb.Tensor(dtype="float32", shape=shape, data=b"")
    with pytest.raises(InvalidGradientError, match=r"impossible|negative"):
        codec.decode_tensor(msg, "rows", InvalidGradientError, codec.FLOAT_DTYPES, 2)
    raw = wire.parse_values_request(wire.encode_values_request([("t", np.zeros(0, np.int64),
                                                                  np.zeros((0, 4), np.float32))]))[0].values
    raw.shape = list(shape)
    with pytest.raises(InvalidGradientError, match=r"impossible|negative"):
        codec.decode_tensor(raw, "rows", InvalidGradientError, codec.FLOAT_DTYPES, 2)
    assert codec.decode_tensor(pb.Tensor(dtype="float32", shape=[0, 64]), "rows", InvalidGradientError,
                               codec.FLOAT_DTYPES, 2).shape == (0, 64), "an empty batch of rows is fine"


def test_missing_tensor_and_int32_keys() -> None:
    with pytest.raises(InvalidKeysError, match="missing"):
        codec.decode_keys(pb.Tensor(), "keys", present=False)
    keys = codec.decode_keys(codec.encode_tensor(np.array([-1, 7], dtype=np.int32)), "keys")
    assert keys.dtype == torch.int64 and keys.tolist() == [-1, 7]


def test_keyset_decoding_checks_counts() -> None:
    ks = codec.decode_keyset(pb.TableKeyset(table="t", keys=codec.encode_tensor(np.array([5, 1, 5]))))
    assert ks.keys.tolist() == [1, 5] and ks.counts.tolist() == [1, 2]  # no counts: the keys are counted
    keys, counts = codec.encode_tensor(np.array([1, 5])), codec.encode_tensor(np.array([3, 4]))
    ks = codec.decode_keyset(pb.TableKeyset(table="t", keys=keys, counts=counts))
    assert ks.counts.tolist() == [3, 4]
    for k, c, match in ([[5, 1], [1, 1], "unique and ascending"], [[1, 5], [1], "1 counts for 2 keys"],
                        [[1, 5], [0, 2], ">= 1"]):
        with pytest.raises(InvalidKeysError, match=match):
            codec.decode_keyset(pb.TableKeyset(table="t", keys=codec.encode_tensor(np.array(k)),
                                               counts=codec.encode_tensor(np.array(c))))


def test_keyset_chunks_merge_into_the_whole_keyset() -> None:
    rng = np.random.default_rng(0)
    keys = torch.from_numpy(np.unique(rng.integers(-2**62, 2**62, 1000)))
    counts = torch.from_numpy(rng.integers(1, 50, keys.numel()))
    whole = Keyset(keys, counts)
    cuts = [0, 1, 300, 301, 999, 1000]  # in order, with empty and one-key chunks: joined as they are
    parts = [Keyset(keys[a:b], counts[a:b]) for a, b in itertools.pairwise(cuts)]
    merged = codec.merge_keysets(parts)
    assert torch.equal(merged.keys, keys) and torch.equal(merged.counts, counts)
    merged = codec.merge_keysets([*parts[::-1], parts[3]])  # out of order and overlapping: counts added
    merged.validate()
    extra = torch.zeros_like(counts)
    extra[301:999] = counts[301:999]
    assert torch.equal(merged.keys, keys) and torch.equal(merged.counts, counts + extra)
    raw = [Keyset.from_keys(torch.tensor([5, 3, 3])), Keyset.from_keys(torch.tensor([3, 9]))]  # raw keys, counted
    merged = codec.merge_keysets(raw)
    assert merged.keys.tolist() == [3, 5, 9] and merged.counts.tolist() == [3, 1, 1]
    assert codec.merge_keysets([whole]) is whole and len(codec.merge_keysets([])) == 0


def test_errors_reported_by_name() -> None:
    err = error_from_name("StoreError", "disk gone", "h:1")
    assert type(err) is StoreError and str(err) == "disk gone"
    assert isinstance(error_from_name("UnavailableError", "bye", "h:1"), UnavailableError)
    odd = error_from_name("ZeroDivisionError", "oops", "h:1")  # not an embcache error: never imported
    assert type(odd) is RemoteError and "ZeroDivisionError: oops (server h:1)" in str(odd)


def test_table_config_round_trip_and_defaults() -> None:
    cfg = TableConfig(name="user", dim=16, optimizer="adam", lr=0.003, seed=-7, init_scale=0.25, dtype="float16",
                      memory_share=2.5)
    wire = pb.TableConfig.FromString(codec.table_to_proto(cfg).SerializeToString())
    assert codec.table_from_proto(wire) == cfg
    assert codec.table_from_proto(pb.TableConfig(name="t", dim=4)) == TableConfig(name="t", dim=4)
    with pytest.raises(ConfigError, match="optimizer"):
        codec.table_from_proto(pb.TableConfig(name="t", dim=4, optimizer="lbfgs"))


# ---------------------------------------------------------------------- errors
class _FakeRpcError(grpc.RpcError):
    """What a failed call raises (code, details, trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, details: str, meta: tuple = ()) -> None:
        self._code, self._details, self._meta = code, details, meta

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._meta


@pytest.mark.parametrize("exc, code", [
    (UnknownTableError("t"), grpc.StatusCode.NOT_FOUND),
    (InvalidKeysError("k"), grpc.StatusCode.INVALID_ARGUMENT),
    (NonFiniteGradientError("nan"), grpc.StatusCode.INVALID_ARGUMENT),
    (BatchTooLargeError("big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TableConflictError("c"), grpc.StatusCode.ALREADY_EXISTS),
    (PassStateError("p"), grpc.StatusCode.FAILED_PRECONDITION),
    (CacheClosedError("closed"), grpc.StatusCode.UNAVAILABLE),
    (StoreError("io"), grpc.StatusCode.INTERNAL),
])
def test_every_error_maps_to_its_code_and_back_to_its_type(exc: Exception, code: grpc.StatusCode) -> None:
    got_code, name = status_of(exc)
    assert got_code == code and name == type(exc).__name__
    back = error_from_rpc(_FakeRpcError(code, str(exc), ((ERROR_TYPE_KEY, name),)), "h:1")
    assert type(back) is type(exc)
    assert str(back) == str(exc)


def test_codes_without_a_type_name() -> None:
    assert isinstance(error_from_rpc(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")), UnavailableError)
    assert isinstance(error_from_rpc(_FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "no")), UnauthenticatedError)
    assert isinstance(error_from_rpc(_FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "no")), PermissionDeniedError)
    big = error_from_rpc(_FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max"))
    assert isinstance(big, BatchTooLargeError)
    # a type name that is not an embcache error is ignored, never imported
    odd = error_from_rpc(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "x", ((ERROR_TYPE_KEY, "SystemExit"),)))
    assert isinstance(odd, UnknownTableError)
    assert not_applied(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "bye", ((NOT_APPLIED_KEY, "1"),)))
    assert not not_applied(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "reset"))


# ---------------------------------------------------------------------- the ring
def test_ring_hash_is_a_bijection_on_a_sample_and_spreads_bits() -> None:
    keys = np.arange(100_000, dtype=np.int64)
    h = ring_hash(keys)
    assert np.unique(h).size == keys.size
    assert abs(float(np.mean(h >> np.uint64(63))) - 0.5) < 0.01  # top bit balanced for consecutive ids


def test_ring_balance_and_determinism() -> None:
    keys = np.random.default_rng(0).integers(-2**62, 2**62, 200_000)
    ring = HashRing(["a:1", "b:1", "c:1"])
    owners = ring.owners(keys)
    share = np.bincount(owners, minlength=3) / keys.size
    assert np.all(np.abs(share - 1 / 3) < 0.05), share
    assert np.array_equal(owners, HashRing(["a:1", "b:1", "c:1"]).owners(keys))
    parts = ring.split(keys)
    assert sum(p.size for p in parts) == keys.size
    for i, p in enumerate(parts):
        assert np.all(owners[p] == i) and np.all(np.diff(p) > 0)


def test_adding_a_shard_moves_about_one_nth_of_the_keys() -> None:
    keys = np.random.default_rng(1).integers(0, 2**40, 200_000)
    before = HashRing(["s0", "s1", "s2", "s3"]).owners(keys)
    after = HashRing(["s0", "s1", "s2", "s3", "s4"]).owners(keys)
    moved = before != after
    assert abs(moved.mean() - 1 / 5) < 0.04, moved.mean()
    assert np.all(after[moved] == 4)  # keys only move to the new shard
    with pytest.raises(ValueError):
        HashRing(["a", "a"])


def test_stats_merge_sums_counters_and_weights_ratios() -> None:
    a = {"t": {"lookups": 30, "hbm": {"hits": 10, "pinned_rows": 0}, "pass": {"active": False},
               "mrc": {"sample_rate": 0.5, "hbm": {"1.0": 0.2}}}}
    b = {"t": {"lookups": 10, "hbm": {"hits": 4, "pinned_rows": 2}, "pass": {"active": True},
               "mrc": {"sample_rate": 0.5, "hbm": {"1.0": 0.6}}}}
    m = _merge_stats([a, b])["t"]
    assert m["lookups"] == 40 and m["hbm"] == {"hits": 14, "pinned_rows": 2} and m["pass"]["active"] is True
    assert math.isclose(m["mrc"]["hbm"]["1.0"], 0.75 * 0.2 + 0.25 * 0.6)


# ---------------------------------------------------------------------- generated stubs
@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_generated_stubs_are_current() -> None:
    from embcache.rpc import regen

    assert regen.main(["--check"]) == 0, "run: python -m embcache.rpc.regen"


# ---------------------------------------------------------------------- the hand-written hot messages
def test_wire_encoding_is_standard_protobuf_both_ways() -> None:
    keys = np.array([3, -1, 2**62], dtype=np.int64)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    req = pb.LookupRequest.FromString(wire.encode_lookup_request([("a", keys), ("bé", keys[:1])]))
    assert [t.table for t in req.tables] == ["a", "bé"]
    assert np.array_equal(codec.decode_keys(req.tables[0].keys, "k").numpy(), keys)
    resp = pb.LookupResponse.FromString(wire.encode_lookup_response([("a", rows)]))
    assert list(resp.tables[0].rows.shape) == [3, 4] and resp.tables[0].rows.data == rows.tobytes()
    vals = pb.ApplyGradientsRequest.FromString(wire.encode_values_request([("a", keys, rows[:, :2].copy())]))
    assert vals.tables[0].values.data == rows[:, :2].tobytes() and list(vals.tables[0].values.shape) == [3, 2]
    # and what the generated classes write, the parser reads (views, no copies)
    msg = pb.AssignRequest(tables=[pb.TableValues(table="t", keys=codec.encode_tensor(keys),
                                                  values=codec.encode_tensor(rows))]).SerializeToString()
    (view,) = wire.parse_values_request(msg)
    assert view.table == "t" and view.HasField("values") and isinstance(view.values.data, memoryview)
    got = codec.decode_tensor(view.values, "rows", InvalidGradientError, codec.FLOAT_DTYPES, 2)
    assert np.array_equal(got, rows)
    (empty,) = wire.parse_lookup_request(pb.LookupRequest(tables=[pb.TableKeys(table="t")]).SerializeToString())
    assert not empty.HasField("keys")


def test_wire_parser_accepts_unknown_fields_and_unpacked_shapes() -> None:
    body = pb.Tensor(dtype="int64", data=np.array([7, 8], dtype="<i8").tobytes()).SerializeToString()
    body += b"\x10\x02"  # shape as an unpacked varint (field 2, wire type 0)
    body += b"\x38\x01" + b"\x45\x00\x00\x00\x00"  # unknown varint field 7 and fixed32 field 8
    entry = b"\x0a\x01t" + b"\x12" + bytes([len(body)]) + body
    msg = b"\x0a" + bytes([len(entry)]) + entry + b"\x10\x05"  # plus an unknown top-level field
    (view,) = wire.parse_lookup_request(msg)
    assert view.keys.shape == [2] and codec.decode_keys(view.keys, "k").tolist() == [7, 8]


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x0a", b"\x0b\x00", b"\x00\x00", b"\x0a\x03\x0a\x01\xff",
                                  b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"])
def test_wire_parser_refuses_malformed_bytes(data: bytes) -> None:
    with pytest.raises(InvalidKeysError, match="malformed"):
        wire.parse_lookup_request(data)


@pytest.mark.parametrize("name_len, n, dim", [(1, 8192, 64), (5, 3, 2), (120, 1, 3), (233, 127, 50), (64, 0, 4)])
def test_wire_tensors_start_aligned_and_replies_fill_in_place(name_len: int, n: int, dim: int) -> None:
    keys = np.arange(n, dtype=np.int64)
    rows = np.arange(n * dim, dtype=np.float32).reshape(n, dim)
    table = "t" * name_len
    msg = wire.encode_values_request([(table, keys, rows), ("u", keys[:1], rows[:1])])
    base = np.frombuffer(msg, dtype=np.uint8).__array_interface__["data"][0]
    for view in wire.parse_values_request(msg):
        for t in (view.keys, view.values):
            if t.data.nbytes:  # every tensor's data is 16-byte aligned in the message: used in place
                assert (np.frombuffer(t.data, dtype=np.uint8).__array_interface__["data"][0] - base) % 16 == 0
    generated = pb.ApplyGradientsRequest.FromString(msg)  # the padding field is standard protobuf
    assert generated.tables[0].values.data == rows.tobytes() and generated.tables[1].keys.data == keys[:1].tobytes()
    reply, views = wire.new_lookup_response([(table, n, dim), ("u", 1, dim)])
    views[0].copy_(torch.from_numpy(rows))
    views[1].copy_(torch.from_numpy(rows[:1] if n else np.zeros((1, dim), dtype=np.float32)))
    assert reply == wire.encode_lookup_response([(table, rows), ("u", views[1].numpy())])
    (parsed, _) = wire.parse_lookup_response(reply)
    got = wire.as_tensor(reply, codec.decode_tensor(parsed.rows, "rows", InvalidGradientError, ("float32",), 2))
    assert torch.equal(got, torch.from_numpy(rows))
    del reply, views
    got += 1  # the rows are the caller's: writable, and they keep the reply alive
    assert torch.equal(got, torch.from_numpy(rows) + 1)


def test_unaligned_tensor_data_is_copied() -> None:
    buf = b"\0" + np.array([1.5, 2.5], dtype="<f4").tobytes()
    raw = wire.RawTensor(dtype="float32", shape=[2], data=memoryview(buf)[1:])  # at an odd address
    arr = codec.decode_tensor(raw, "x", InvalidGradientError, ("float32",), 1)
    assert arr.flags.aligned and arr.tolist() == [1.5, 2.5]


def test_shard_map_loses_says_exactly_which_shards_give_keys_away() -> None:
    from embcache.ring import ShardMap

    two, three = ShardMap(1, {"a": "x:1", "b": "x:2"}), ShardMap(2, {"a": "x:1", "b": "x:2", "c": "x:3"})
    keys = np.arange(200_000)
    for before, after in ((two, three), (three, two)):
        for name in ("a", "b", "c"):
            lost = (before.owned_by(keys, name) & ~after.owned_by(keys, name)).any()
            assert before.loses(name, after) == bool(lost), (name, before.version)
    assert two.loses("a", three) and not three.loses("a", two) and three.loses("c", two)
    assert two == ShardMap(1, {"b": "elsewhere:2", "a": "x:1"})  # names, not addresses, make a map
    assert ShardMap.from_json(three.to_json()) == three


def test_ring_owner_lookup_matches_a_binary_search_everywhere_on_the_ring() -> None:
    rng = np.random.default_rng(3)
    for names in (["a", "b"], ["a", "b", "c"], [f"s{i}" for i in range(17)]):
        ring = HashRing(names)
        hashes = np.concatenate([rng.integers(0, 2**63, 50_000).astype(np.uint64) * np.uint64(2),
                                 ring.points, ring.points - np.uint64(1), ring.points + np.uint64(1),
                                 np.array([0, 2**64 - 1], dtype=np.uint64)])
        expected = np.searchsorted(ring.points, hashes, side="left")
        expected[expected == ring.points.shape[0]] = 0
        assert np.array_equal(ring.owners_of_hashes(hashes), ring.owners_of_hashes(hashes))
        assert np.array_equal(ring.owners_of_hashes(hashes), np.asarray(ring._owners)[expected])
