from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "padding")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    padding: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., padding: _Optional[bytes] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "lr", "eps", "beta1", "beta2", "weight_decay", "initial_accumulator_value", "initializer", "init_scale", "seed", "dtype", "memory_share", "admit_after", "unadmitted", "ttl_steps", "ttl_seconds", "stochastic_rounding")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SHARE_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    UNADMITTED_FIELD_NUMBER: _ClassVar[int]
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_ROUNDING_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: str
    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    initial_accumulator_value: float
    initializer: str
    init_scale: float
    seed: int
    dtype: str
    memory_share: float
    admit_after: int
    unadmitted: str
    ttl_steps: int
    ttl_seconds: float
    stochastic_rounding: bool
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., eps: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., weight_decay: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., initializer: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ..., dtype: _Optional[str] = ..., memory_share: _Optional[float] = ..., admit_after: _Optional[int] = ..., unadmitted: _Optional[str] = ..., ttl_steps: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., stochastic_rounding: _Optional[bool] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "max_batch_keys", "reject_nonfinite", "max_receive_message_bytes", "max_send_message_bytes", "device", "durability", "max_lease_seconds", "incarnation", "shard_map", "serving_version", "serving_directory")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    REJECT_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEND_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    version: str
    max_batch_keys: int
    reject_nonfinite: bool
    max_receive_message_bytes: int
    max_send_message_bytes: int
    device: str
    durability: str
    max_lease_seconds: float
    incarnation: int
    shard_map: str
    serving_version: int
    serving_directory: str
    def __init__(self, version: _Optional[str] = ..., max_batch_keys: _Optional[int] = ..., reject_nonfinite: _Optional[bool] = ..., max_receive_message_bytes: _Optional[int] = ..., max_send_message_bytes: _Optional[int] = ..., device: _Optional[str] = ..., durability: _Optional[str] = ..., max_lease_seconds: _Optional[float] = ..., incarnation: _Optional[int] = ..., shard_map: _Optional[str] = ..., serving_version: _Optional[int] = ..., serving_directory: _Optional[str] = ...) -> None: ...

class WriteReceipt(_message.Message):
    __slots__ = ("incarnation", "seq")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    seq: int
    def __init__(self, incarnation: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class DurableThrough(_message.Message):
    __slots__ = ("incarnation", "durable_seq", "known")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQ_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    durable_seq: int
    known: bool
    def __init__(self, incarnation: _Optional[int] = ..., durable_seq: _Optional[int] = ..., known: _Optional[bool] = ...) -> None: ...

class TableKeys(_message.Message):
    __slots__ = ("table", "keys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: Tensor
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("table", "rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: Tensor
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TableValues(_message.Message):
    __slots__ = ("table", "keys", "values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: Tensor
    values: Tensor
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TableKeyset(_message.Message):
    __slots__ = ("table", "keys", "counts")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: Tensor
    counts: Tensor
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., counts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: TableConfig
    def __init__(self, table: _Optional[_Union[TableConfig, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables", "server")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableConfig]
    server: ServerInfo
    def __init__(self, tables: _Optional[_Iterable[_Union[TableConfig, _Mapping]]] = ..., server: _Optional[_Union[ServerInfo, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableKeys]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableKeys, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class ApplyGradientsRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableValues]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableValues, _Mapping]]] = ...) -> None: ...

class ApplyGradientsResponse(_message.Message):
    __slots__ = ("receipt",)
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    receipt: WriteReceipt
    def __init__(self, receipt: _Optional[_Union[WriteReceipt, _Mapping]] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableValues]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableValues, _Mapping]]] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("receipt",)
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    receipt: WriteReceipt
    def __init__(self, receipt: _Optional[_Union[WriteReceipt, _Mapping]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableKeys]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableKeys, _Mapping]]] = ...) -> None: ...

class TableCount(_message.Message):
    __slots__ = ("table", "rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: int
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("receipt", "tables")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    receipt: WriteReceipt
    tables: _containers.RepeatedCompositeFieldContainer[TableCount]
    def __init__(self, receipt: _Optional[_Union[WriteReceipt, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[TableCount, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("keysets", "wait")
    KEYSETS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    keysets: _containers.RepeatedCompositeFieldContainer[TableKeyset]
    wait: bool
    def __init__(self, keysets: _Optional[_Iterable[_Union[TableKeyset, _Mapping]]] = ..., wait: _Optional[bool] = ...) -> None: ...

class PrefetchTableResult(_message.Message):
    __slots__ = ("table", "staged_rows", "leased_rows", "seconds")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STAGED_ROWS_FIELD_NUMBER: _ClassVar[int]
    LEASED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    staged_rows: int
    leased_rows: int
    seconds: float
    def __init__(self, table: _Optional[str] = ..., staged_rows: _Optional[int] = ..., leased_rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("done", "tables")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    done: bool
    tables: _containers.RepeatedCompositeFieldContainer[PrefetchTableResult]
    def __init__(self, done: _Optional[bool] = ..., tables: _Optional[_Iterable[_Union[PrefetchTableResult, _Mapping]]] = ...) -> None: ...

class BeginPassRequest(_message.Message):
    __slots__ = ("keysets",)
    KEYSETS_FIELD_NUMBER: _ClassVar[int]
    keysets: _containers.RepeatedCompositeFieldContainer[TableKeyset]
    def __init__(self, keysets: _Optional[_Iterable[_Union[TableKeyset, _Mapping]]] = ...) -> None: ...

class PassTableReport(_message.Message):
    __slots__ = ("table", "keyset_rows", "pinned_rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYSET_ROWS_FIELD_NUMBER: _ClassVar[int]
    PINNED_ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keyset_rows: int
    pinned_rows: int
    def __init__(self, table: _Optional[str] = ..., keyset_rows: _Optional[int] = ..., pinned_rows: _Optional[int] = ...) -> None: ...

class BeginPassResponse(_message.Message):
    __slots__ = ("tables", "incarnation")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[PassTableReport]
    incarnation: int
    def __init__(self, tables: _Optional[_Iterable[_Union[PassTableReport, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class PrefetchBatchRequest(_message.Message):
    __slots__ = ("keysets", "ttl_seconds")
    KEYSETS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keysets: _containers.RepeatedCompositeFieldContainer[TableKeyset]
    ttl_seconds: float
    def __init__(self, keysets: _Optional[_Iterable[_Union[TableKeyset, _Mapping]]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class PrefetchBatchResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "incarnation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: float
    incarnation: int
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., incarnation: _Optional[int] = ...) -> None: ...

class LeaseStatus(_message.Message):
    __slots__ = ("lease_id", "state", "tables", "error_type", "error_message")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[LeaseStatus.State]
        STAGING: _ClassVar[LeaseStatus.State]
        DONE: _ClassVar[LeaseStatus.State]
        FAILED: _ClassVar[LeaseStatus.State]
        CANCELLED: _ClassVar[LeaseStatus.State]
    UNKNOWN: LeaseStatus.State
    STAGING: LeaseStatus.State
    DONE: LeaseStatus.State
    FAILED: LeaseStatus.State
    CANCELLED: LeaseStatus.State
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    state: LeaseStatus.State
    tables: _containers.RepeatedCompositeFieldContainer[PrefetchTableResult]
    error_type: str
    error_message: str
    def __init__(self, lease_id: _Optional[str] = ..., state: _Optional[_Union[LeaseStatus.State, str]] = ..., tables: _Optional[_Iterable[_Union[PrefetchTableResult, _Mapping]]] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("lease_ids", "wait_seconds")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    wait_seconds: float
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("leases", "incarnation")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStatus]
    incarnation: int
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseStatus, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("lease_ids", "cancel")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    cancel: bool
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStatus]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseStatus, _Mapping]]] = ...) -> None: ...

class EndPassRequest(_message.Message):
    __slots__ = ("wait",)
    WAIT_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    def __init__(self, wait: _Optional[bool] = ...) -> None: ...

class EndPassResponse(_message.Message):
    __slots__ = ("done", "written_rows", "incarnation")
    DONE_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    done: bool
    written_rows: int
    incarnation: int
    def __init__(self, done: _Optional[bool] = ..., written_rows: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("incarnations",)
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    incarnations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, incarnations: _Optional[_Iterable[int]] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("incarnation", "durable")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    durable: _containers.RepeatedCompositeFieldContainer[DurableThrough]
    def __init__(self, incarnation: _Optional[int] = ..., durable: _Optional[_Iterable[_Union[DurableThrough, _Mapping]]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("directory", "incarnations")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    directory: str
    incarnations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, directory: _Optional[str] = ..., incarnations: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("directory", "incarnation", "durable")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    directory: str
    incarnation: int
    durable: _containers.RepeatedCompositeFieldContainer[DurableThrough]
    def __init__(self, directory: _Optional[str] = ..., incarnation: _Optional[int] = ..., durable: _Optional[_Iterable[_Union[DurableThrough, _Mapping]]] = ...) -> None: ...

class ResidentKeysRequest(_message.Message):
    __slots__ = ("table", "tier")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    table: str
    tier: str
    def __init__(self, table: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class ResidentKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: Tensor
    def __init__(self, keys: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ShardMapState(_message.Message):
    __slots__ = ("current", "pending", "name", "frozen", "ledger")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    current: str
    pending: str
    name: str
    frozen: bool
    ledger: str
    def __init__(self, current: _Optional[str] = ..., pending: _Optional[str] = ..., name: _Optional[str] = ..., frozen: _Optional[bool] = ..., ledger: _Optional[str] = ...) -> None: ...

class GetShardMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetShardMapRequest(_message.Message):
    __slots__ = ("name", "current", "pending", "freeze")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FREEZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    current: str
    pending: str
    freeze: bool
    def __init__(self, name: _Optional[str] = ..., current: _Optional[str] = ..., pending: _Optional[str] = ..., freeze: _Optional[bool] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("table", "pending_version", "batch_rows", "written_only")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_ONLY_FIELD_NUMBER: _ClassVar[int]
    table: str
    pending_version: int
    batch_rows: int
    written_only: bool
    def __init__(self, table: _Optional[str] = ..., pending_version: _Optional[int] = ..., batch_rows: _Optional[int] = ..., written_only: _Optional[bool] = ...) -> None: ...

class ExportRowsResponse(_message.Message):
    __slots__ = ("to", "keys", "records", "freq")
    TO_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FREQ_FIELD_NUMBER: _ClassVar[int]
    to: str
    keys: Tensor
    records: bytes
    freq: Tensor
    def __init__(self, to: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., records: _Optional[bytes] = ..., freq: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ImportRowsRequest(_message.Message):
    __slots__ = ("table", "pending_version", "keys", "records", "freq")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FREQ_FIELD_NUMBER: _ClassVar[int]
    table: str
    pending_version: int
    keys: Tensor
    records: bytes
    freq: Tensor
    def __init__(self, table: _Optional[str] = ..., pending_version: _Optional[int] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., records: _Optional[bytes] = ..., freq: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ImportRowsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class CommitShardMapRequest(_message.Message):
    __slots__ = ("version", "ledger")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    version: int
    ledger: str
    def __init__(self, version: _Optional[int] = ..., ledger: _Optional[str] = ...) -> None: ...

class CommitShardMapResponse(_message.Message):
    __slots__ = ("state", "deleted_rows")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DELETED_ROWS_FIELD_NUMBER: _ClassVar[int]
    state: ShardMapState
    deleted_rows: int
    def __init__(self, state: _Optional[_Union[ShardMapState, _Mapping]] = ..., deleted_rows: _Optional[int] = ...) -> None: ...

class ExportDeltaRequest(_message.Message):
    __slots__ = ("tables", "with_state", "chain", "base_version", "full", "batch_rows")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    with_state: bool
    chain: str
    base_version: int
    full: bool
    batch_rows: int
    def __init__(self, tables: _Optional[_Iterable[str]] = ..., with_state: _Optional[bool] = ..., chain: _Optional[str] = ..., base_version: _Optional[int] = ..., full: _Optional[bool] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class ExportDeltaResponse(_message.Message):
    __slots__ = ("export_id", "full", "steps", "table", "keys", "weights", "state", "deleted")
    class StepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    full: bool
    steps: _containers.ScalarMap[str, int]
    table: str
    keys: Tensor
    weights: bytes
    state: bytes
    deleted: Tensor
    def __init__(self, export_id: _Optional[str] = ..., full: _Optional[bool] = ..., steps: _Optional[_Mapping[str, int]] = ..., table: _Optional[str] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[bytes] = ..., state: _Optional[bytes] = ..., deleted: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CommitExportRequest(_message.Message):
    __slots__ = ("export_id", "chain", "version")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    chain: str
    version: int
    def __init__(self, export_id: _Optional[str] = ..., chain: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class CommitExportResponse(_message.Message):
    __slots__ = ("dropped_marks",)
    DROPPED_MARKS_FIELD_NUMBER: _ClassVar[int]
    dropped_marks: int
    def __init__(self, dropped_marks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
