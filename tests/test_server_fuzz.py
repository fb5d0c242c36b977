"""A fuzzer of the gRPC surface of one embcache-server process: malformed bytes get their code, never INTERNAL.

Every method of ``EmbeddingCacheService`` gets requests as raw bytes: valid seeds, seeds mutated
(bits flipped, truncated, bytes inserted or overwritten, seeds joined), random bytes, and
generated messages with hostile field values (impossible shapes, unknown dtypes, data of the
wrong length, huge or negative numbers). Each case must end with a status other than INTERNAL
or UNKNOWN, the server must keep answering, and rows must not change: the rows of table
``keep``, which no case writes by design, at the end, and the rows of table ``fuzz``, which the
write seeds target, after every case that was refused (a refused write changes nothing).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from embcache.rpc import codec
from embcache.rpc.errors import ERROR_TYPE_KEY
from embcache.rpc.v1 import embcache_pb2 as pb
from embcache.server.local import LocalServer
from embcache.server.main import build_parser
from embcache.server.servicer import ROLES, SERVICE_NAME, roles_text

START_TIMEOUT = 300
METHODS = {m.name: m for m in pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].methods}
KEYS = np.arange(16, dtype=np.int64)
RW_TOKEN, RO_TOKEN = "fuzz-rw", "fuzz-ro"
CASES_PER_METHOD = 60  # x 26 methods: 1,560 cases, plus the fixed malformed ones


def _t(values: Any, dtype: Any = np.int64) -> pb.Tensor:
    return codec.encode_tensor(np.asarray(values, dtype=dtype))


def _keyset(table: str = "fuzz", keys: np.ndarray = KEYS) -> pb.TableKeyset:
    return pb.TableKeyset(table=table, keys=_t(keys))


def _values(table: str = "fuzz", n: int = 16, dim: int = 4) -> pb.TableValues:
    return pb.TableValues(table=table, keys=_t(KEYS[:n]), values=_t(np.full((n, dim), 0.25), np.float32))


def _seeds() -> dict[str, list[list[bytes]]]:
    """Valid requests of every method (each a list of messages: one for unary requests, chunks for streams)."""
    one = {
        "CreateTable": [pb.CreateTableRequest(table=pb.TableConfig(name="keep", dim=4)),
                        pb.CreateTableRequest(table=pb.TableConfig(name="fz", dim=4, optimizer="adagrad", lr=0.1))],
        "ListTables": [pb.ListTablesRequest()],
        "Lookup": [pb.LookupRequest(tables=[pb.TableKeys(table="keep", keys=_t(KEYS))]),
                   pb.LookupRequest(tables=[pb.TableKeys(table="fuzz", keys=_t(KEYS, np.int32))])],
        "ApplyGradients": [pb.ApplyGradientsRequest(tables=[_values()])],
        "Assign": [pb.AssignRequest(tables=[_values()])],
        "Delete": [pb.DeleteRequest(tables=[pb.TableKeys(table="fuzz", keys=_t(KEYS[:4]))])],
        "Prefetch": [pb.PrefetchRequest(keysets=[_keyset()], wait=True)],
        "BeginPass": [pb.BeginPassRequest(keysets=[_keyset()])],
        "EndPass": [pb.EndPassRequest(wait=True)],
        "PrefetchBatch": [pb.PrefetchBatchRequest(keysets=[_keyset()], ttl_seconds=0.5)],
        "RenewLeases": [pb.RenewLeasesRequest(lease_ids=["0123456789abcdef"], wait_seconds=0.01)],
        "ReleaseLeases": [pb.ReleaseLeasesRequest(lease_ids=["0123456789abcdef"], cancel=True)],
        "Flush": [pb.FlushRequest()],
        "Checkpoint": [pb.CheckpointRequest(directory="ck")],
        "Stats": [pb.StatsRequest()],
        "ResidentKeys": [pb.ResidentKeysRequest(table="fuzz", tier="ddr")],
        # the resharding calls, with no migration pending: each is refused (and changes no map)
        "GetShardMap": [pb.GetShardMapRequest()],
        "SetShardMap": [pb.SetShardMapRequest(name="s0", current="{not a map", pending="")],
        "ExportRows": [pb.ExportRowsRequest(table="fuzz", pending_version=999, batch_rows=16)],
        "ImportRows": [pb.ImportRowsRequest(table="fuzz", pending_version=999, keys=_t(KEYS[:2]),
                                            records=b"\0" * 64, freq=_t([1.0, 2.0], np.float32))],
        "CommitShardMap": [pb.CommitShardMapRequest(version=999)],
        # delta export: a small full export (it changes no row), and the commit of an unknown export (refused)
        "ExportDelta": [pb.ExportDeltaRequest(tables=["fuzz"], batch_rows=16)],
        "CommitExport": [pb.CommitExportRequest(export_id="none", chain="c", version=1)],
    }
    seeds = {name: [[m.SerializeToString()] for m in msgs] for name, msgs in one.items()}
    seeds["ApplyGradientsStream"] = [[pb.ApplyGradientsRequest(tables=[_values()]).SerializeToString()] * 2]
    seeds["AssignStream"] = [[pb.AssignRequest(tables=[_values()]).SerializeToString()] * 2]
    seeds["PrefetchStream"] = [[pb.PrefetchRequest(keysets=[_keyset()], wait=True).SerializeToString(),
                                pb.PrefetchRequest(keysets=[_keyset(keys=KEYS + 100)]).SerializeToString()]]
    seeds["BeginPassStream"] = [[pb.BeginPassRequest(keysets=[_keyset()]).SerializeToString()]]
    seeds["PrefetchBatchStream"] = [[pb.PrefetchBatchRequest(keysets=[_keyset()],
                                                             ttl_seconds=0.5).SerializeToString()]]
    assert set(seeds) == set(METHODS), set(METHODS) ^ set(seeds)
    return seeds


_HOSTILE_INTS = [0, 1, -1, 7, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63), -(2**31)]


def _hostile_tensor(rng: random.Random) -> pb.Tensor:
    """A Tensor with a dtype, shape and data length chosen to disagree (or, now and then, to agree)."""
    dtype = rng.choice(["int64", "int32", "float32", "float16", "float64", "", "int8", "bfloat16", "x" * 40])
    shape = [rng.choice([*_HOSTILE_INTS, rng.randrange(0, 40)]) for _ in range(rng.randrange(0, 4))]
    size = rng.choice([0, 1, 7, 8, 16, 64, 128, rng.randrange(0, 300)])
    data = bytes(rng.getrandbits(8) for _ in range(size))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def _generated(name: str, rng: random.Random) -> list[bytes]:
    """A message of the method's request type with hostile field values (tables 'fuzz' or unknown ones)."""
    table = rng.choice(["fuzz", "fuzz", "nope", "", "f\u00fczz"])
    kind = METHODS[name].input_type.name
    msg: Any
    if kind in ("LookupRequest", "DeleteRequest"):
        msg = getattr(pb, kind)(tables=[pb.TableKeys(table=table, keys=_hostile_tensor(rng))])
    elif kind in ("ApplyGradientsRequest", "AssignRequest"):
        values = pb.TableValues(table=table, keys=_hostile_tensor(rng), values=_hostile_tensor(rng))
        msg = getattr(pb, kind)(tables=[values])
    elif kind in ("PrefetchRequest", "BeginPassRequest", "PrefetchBatchRequest"):
        keyset = pb.TableKeyset(table=table, keys=_hostile_tensor(rng))
        if rng.random() < 0.5:
            keyset.counts.CopyFrom(_hostile_tensor(rng))
        msg = getattr(pb, kind)(keysets=[keyset])
        if kind == "PrefetchBatchRequest":
            msg.ttl_seconds = rng.choice([-1.0, 0.0, 0.5, float("nan"), float("inf"), 1e300])
    elif kind == "CreateTableRequest":
        cfg = pb.TableConfig(name=rng.choice(["keep", "fuzz", "", "x" * 300, "a/b", "g"]),
                             dim=rng.choice([0, 1, 4, 2**31 - 1, 2**20, -5]))
        for field_name, choices in (("optimizer", ["sgd", "adagrad", "bogus", ""]),
                                    ("lr", [float("nan"), -1.0, 0.1, float("inf")]),
                                    ("dtype", ["float32", "float16", "int8", ""]),
                                    ("memory_share", [float("nan"), -1.0, 0.0, 1e9]),
                                    ("seed", [-1, 2**63 - 1]), ("initializer", ["normal", "zeros", "??"])):
            if rng.random() < 0.4:
                setattr(cfg, field_name, rng.choice(choices))
        msg = pb.CreateTableRequest(table=cfg)
    elif kind == "RenewLeasesRequest":
        msg = pb.RenewLeasesRequest(lease_ids=["", "x" * 1000, "\u00e9"],
                                    wait_seconds=rng.choice([-1.0, float("nan"), float("inf"), 1e300, 0.01]))
    elif kind == "ReleaseLeasesRequest":
        msg = pb.ReleaseLeasesRequest(lease_ids=["", "x" * 1000], cancel=rng.random() < 0.5)
    elif kind == "CheckpointRequest":
        msg = pb.CheckpointRequest(directory=rng.choice(["", ".", "..", "../../x", "/", "a\0b", "x" * 5000]))
    elif kind == "ResidentKeysRequest":
        msg = pb.ResidentKeysRequest(table=table, tier=rng.choice(["hbm", "ddr", "ssd", "", "HBM"]))
    elif kind == "EndPassRequest":
        msg = pb.EndPassRequest(wait=rng.random() < 0.5)
    else:  # ListTables, Flush, Stats: no fields; unknown fields instead
        msg = getattr(pb, kind)()
        return [msg.SerializeToString() + b"\x08\x01" + b"\x12\x03abc" + struct.pack("<B", 0x1d) + b"\0\0\0\0"]
    data = msg.SerializeToString()
    return [data] * (2 if METHODS[name].client_streaming and rng.random() < 0.3 else 1)


def _mutate(data: bytes, rng: random.Random, other: bytes) -> bytes:
    """One random mutation of ``data``."""
    op = rng.randrange(7)
    buf = bytearray(data)
    if op == 0 or not buf:  # random bytes
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
    if op == 1:  # flip bits
        for _ in range(rng.randrange(1, 5)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 2:  # truncate
        del buf[rng.randrange(len(buf)):]
    elif op == 3:  # insert bytes
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 9)))
    elif op == 4:  # overwrite a byte with a boundary value
        buf[rng.randrange(len(buf))] = rng.choice([0x00, 0xFF, 0x80, 0x7F])
    elif op == 5:  # join with another seed (valid protobuf merges fields; repeated ones add up)
        return data + other
    else:  # an overlong varint somewhere
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = b"\xff" * 11
    return bytes(buf)


class Fuzzer:
    """Sends raw bytes to every method over one channel and records the status codes."""

    def __init__(self, channel: grpc.Channel, token: str = RW_TOKEN) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._calls: dict[str, Callable[[list[bytes]], Any]] = {}
        for name, m in METHODS.items():
            path = f"/{SERVICE_NAME}/{name}"
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
                (m.client_streaming, m.server_streaming)]
            rpc = kind(path, request_serializer=None, response_deserializer=None)
            self._calls[name] = self._wrap(rpc, m.client_streaming, m.server_streaming, self._metadata)
        self.codes: dict[str, dict[str, int]] = {}

    @staticmethod
    def _wrap(rpc: Any, client_streaming: bool, server_streaming: bool,
              metadata: Any) -> Callable[[list[bytes]], Any]:
        def call(messages: list[bytes]) -> Any:
            body: Any = iter(messages) if client_streaming else messages[0]
            reply = rpc(body, timeout=30, metadata=metadata)
            return list(reply) if server_streaming else reply
        return call

    def send(self, name: str, messages: list[bytes]) -> grpc.RpcError | None:
        try:
            self._calls[name](messages)
        except grpc.RpcError as err:
            code = err.code()
            self.codes.setdefault(name, {}).setdefault(code.name, 0)
            self.codes[name][code.name] += 1
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                name, code, err.details(), [m[:200] for m in messages])
            return err
        self.codes.setdefault(name, {}).setdefault("OK", 0)
        self.codes[name]["OK"] += 1
        return None


def _rows(channel: grpc.Channel, table: str) -> bytes:
    reply = channel.unary_unary(f"/{SERVICE_NAME}/Lookup")(
        pb.LookupRequest(tables=[pb.TableKeys(table=table, keys=_t(KEYS))]).SerializeToString(), timeout=30,
        metadata=(("authorization", f"Bearer {RW_TOKEN}"),))
    return bytes(reply)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, grpc.Channel]]:
    base = tmp_path_factory.mktemp("fuzz")
    (base / "rw.txt").write_text(f"{RW_TOKEN}\n")
    (base / "ro.txt").write_text(f"{RO_TOKEN}\n")
    server = LocalServer(base / "store", tables=["name=keep,dim=4", "name=fuzz,dim=4,optimizer=adagrad"],
                         args=["--hbm-bytes", "200000", "--ddr-bytes", "400000", "--max-batch-keys", "4096",
                               "--max-message-bytes", "1048576", "--max-lease-seconds", "1",
                               "--auth-token-file", str(base / "rw.txt"),
                               "--auth-readonly-token-file", str(base / "ro.txt")],
                         workdir=base / "run", start_timeout=START_TIMEOUT).start()
    channel = grpc.insecure_channel(server.address)
    assign = channel.unary_unary(f"/{SERVICE_NAME}/Assign")
    for table in ("keep", "fuzz"):
        assign(pb.AssignRequest(tables=[pb.TableValues(table=table, keys=_t(KEYS), values=_t(
            np.arange(64).reshape(16, 4), np.float32))]).SerializeToString(), timeout=30,
            metadata=(("authorization", f"Bearer {RW_TOKEN}"),))
    yield server, channel
    channel.close()
    server.stop()


# Bytes that no parser can take for a valid message: a field number 0, a length past the end, an
# overlong varint, a truncated fixed64, an end-group tag without a group.
MALFORMED = [b"\x00", b"\x0a\x05ab", b"\xff" * 11, b"\x09\x01\x02", b"\x0c"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_malformed_bytes_get_invalid_argument_for_every_method(fuzz_server: tuple[LocalServer, grpc.Channel],
                                                               name: str) -> None:
    _, channel = fuzz_server
    fuzzer = Fuzzer(channel)
    for data in MALFORMED:
        messages = [data] if not METHODS[name].client_streaming else [_seeds()[name][0][0], data]
        err = fuzzer.send(name, messages)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, data, err)
        assert dict(err.trailing_metadata() or ()).get(ERROR_TYPE_KEY) == "InvalidKeysError", (name, data)
        assert "malformed" in (err.details() or ""), err.details()


def test_fuzzer_of_every_method_gets_no_internal_and_changes_no_row(
        fuzz_server: tuple[LocalServer, grpc.Channel]) -> None:
    server, channel = fuzz_server
    rng = random.Random(20240611)
    seeds = _seeds()
    every = [m for chunks in seeds.values() for m in chunks for m in m]
    keep, fuzz = _rows(channel, "keep"), _rows(channel, "fuzz")
    fuzzer = Fuzzer(channel)
    cases = 0
    for name in sorted(METHODS):
        for i in range(CASES_PER_METHOD):
            if i % 4 == 3:
                messages = _generated(name, rng)
            else:
                seed = rng.choice(seeds[name])
                messages = list(seed)
                j = rng.randrange(len(messages))
                messages[j] = _mutate(messages[j], rng, rng.choice(every))
            err = fuzzer.send(name, messages)
            cases += 1
            if err is not None:  # refused: the rows it named are as they were
                assert _rows(channel, "fuzz") == fuzz, (name, err.code(), err.details(), messages)
            else:
                fuzz = _rows(channel, "fuzz")
    assert cases >= 1000
    assert server.proc is not None and server.proc.poll() is None, "the server is still up"
    assert _rows(channel, "keep") == keep, "no case wrote table keep"
    refused = sum(n for codes in fuzzer.codes.values() for code, n in codes.items() if code != "OK")
    assert refused > cases // 2, fuzzer.codes  # most mutations are refused: the fuzzer reaches the checks
    print(f"{cases} cases: {fuzzer.codes}")


def test_token_roles_come_from_one_table_that_help_and_readme_show(
        fuzz_server: tuple[LocalServer, grpc.Channel]) -> None:
    """ROLES decides: a read-only token's call of a "write" method is refused, of a "read" one served."""
    _, channel = fuzz_server
    assert set(ROLES) == set(METHODS)
    keep = _rows(channel, "keep")
    seeds = _seeds()
    read_only, anonymous = Fuzzer(channel, RO_TOKEN), Fuzzer(channel, "")
    for name, role in sorted(ROLES.items()):
        err = read_only.send(name, seeds[name][0])
        if role == "write":
            assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, (name, err)
            assert "read-write token" in (err.details() or "")
        else:
            assert err is None or err.code() not in (grpc.StatusCode.PERMISSION_DENIED,
                                                     grpc.StatusCode.UNAUTHENTICATED), (name, err)
        err = anonymous.send(name, seeds[name][0])
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, (name, err)
    assert _rows(channel, "keep") == keep
    assert roles_text() in build_parser().format_help()
    page = (Path(__file__).resolve().parents[1] / "docs" / "operations" / "server.md").read_text()
    block = page.split("<!-- roles:begin -->\n", 1)[1].split("\n<!-- roles:end -->", 1)[0]
    assert block == roles_text(markdown=True), \
        "docs/operations/server.md's roles table is stale: paste roles_text(markdown=True)"


def test_malformed_health_checks_get_invalid_argument_and_health_still_answers(
        fuzz_server: tuple[LocalServer, grpc.Channel]) -> None:
    _, channel = fuzz_server
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    for data in MALFORMED:
        with pytest.raises(grpc.RpcError) as info:
            check(data, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, info.value)
    assert check(b"", timeout=10) == b"\x08\x01", "SERVING"
