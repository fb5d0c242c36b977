"""Configuration dataclasses, validated when built.

``TableConfig`` describes one embedding table; ``CacheConfig`` the tiers and the policy shared
by every table of a cache. Invalid values raise :class:`embcache.errors.ConfigError` naming the
field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError
from .types import Initializer, Optimizer, PolicyName, StorageDtype, StoreKind

__all__ = ["CacheConfig", "ScoreFn", "TableConfig", "device_memory_bytes", "machine_memory_bytes", "memory_limit_bytes"]

#: A user-supplied eviction score: ``fn(freq, last, now) -> score`` over tensors of resident rows
#: (``freq`` float64 aged frequency, ``last`` int64 tick of the last access, ``now`` the current
#: tick). Rows with the smallest score are evicted first.
ScoreFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

_DEFAULT_EPS = {
    Optimizer.SGD: 0.0,
    Optimizer.ADAGRAD: 1e-10,
    Optimizer.ROWWISE_ADAGRAD: 1e-10,
    Optimizer.ADAM: 1e-8,
    Optimizer.ROWWISE_ADAGRAD_MOMENTUM: 1e-10,
}


def _is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A real number (int, float, or numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _enum_value(enum: type[Any], value: Any, field_name: str) -> Any:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum)
        raise ConfigError(f"{field_name}={value!r} is not allowed; choose one of {allowed}") from None


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique table name (non-empty, at most 128 characters).
        dim: embedding dimension (1..65536).
        optimizer: "sgd", "adagrad", "rowwise_adagrad", "adam" or "rowwise_adagrad_momentum"
            (momentum-scaled row-wise AdaGrad: ``beta1`` is its momentum; see :mod:`embcache.optim`).
        lr: learning rate (> 0).
        eps: optimizer epsilon; None picks torch's default for the optimizer
            (Adagrad 1e-10, Adam 1e-8).
        beta1, beta2: Adam's decay rates in [0, 1); beta1 is also the momentum of
            "rowwise_adagrad_momentum".
        weight_decay: L2 penalty added to the gradient, as torch does (>= 0).
        initial_accumulator_value: AdaGrad's starting sum of squares (>= 0).
        initializer: "uniform" (U(-init_scale, init_scale)), "normal" (N(0, init_scale)) or "zeros".
        init_scale: scale of the initializer; None means 1/sqrt(dim).
        seed: seed of the lazy initializer; a row's first value is a pure function of (seed, key).
        dtype: storage dtype of the weights: "float32", "float16" or "bfloat16".
        memory_share: relative share of the cache's HBM and DDR bytes this table gets (> 0).
        admit_after: admission of new keys: a key gets a trained, stored row only once it has been
            looked up this many times (0 or 1: at once, the default). Until then a lookup returns
            ``unadmitted`` rows and its gradients are dropped (``stats()[table]["admission"]``).
            Lookups are counted in a count-min sketch of the table (a few in a million keys may be
            admitted a little early, never late); the counts are saved with the frequencies.
        unadmitted: what a lookup of a key not admitted yet returns: "init" (the initializer's
            row, which the key would start from) or "zeros".
        ttl_steps: expiry: a row not touched (looked up or updated) for more than this many
            steps of the table's clock is deleted from every tier and the store by the cache's
            background sweeper (0: off, the default). A step is one key occurrence looked up in
            this table (a lookup of a batch of n keys advances the clock by n), the same clock
            the eviction policy ages by. See ``stats()[table]["expiry"]``.
        ttl_seconds: expiry by wall time: a row not touched for more than this many seconds is
            deleted (0: off). With both set, a row expires when either is exceeded.
        stochastic_rounding: round updated weights to a float16/bfloat16 ``dtype`` stochastically
            (unbiased: up with probability ``(x - lo) / (hi - lo)``), with random numbers that are
            a hash of (seed, key, update step, column), instead of to nearest. Only for float16 and
            bfloat16 storage: with float32 it is a ConfigError. See :mod:`embcache.rounding`.
    """

    name: str
    dim: int
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float | None = None
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    initializer: str = "uniform"
    init_scale: float | None = None
    seed: int = 0
    dtype: str = "float32"
    memory_share: float = 1.0
    admit_after: int = 0
    unadmitted: str = "init"
    ttl_steps: int = 0
    ttl_seconds: float = 0.0
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 128:
            raise ConfigError(f"TableConfig.name={self.name!r}: must be a non-empty string of at most 128 characters")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or not 1 <= self.dim <= 65536:
            raise ConfigError(f"TableConfig.dim={self.dim!r}: must be an int in 1..65536")
        opt = _enum_value(Optimizer, self.optimizer, "TableConfig.optimizer")
        object.__setattr__(self, "optimizer", opt.value)
        init = _enum_value(Initializer, self.initializer, "TableConfig.initializer")
        object.__setattr__(self, "initializer", init.value)
        dt = _enum_value(StorageDtype, self.dtype, "TableConfig.dtype")
        object.__setattr__(self, "dtype", dt.value)
        for name in ("lr", "weight_decay", "initial_accumulator_value", "memory_share", "beta1", "beta2"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"TableConfig.{name}={value!r}: must be a finite number")
        if self.lr <= 0:
            raise ConfigError(f"TableConfig.lr={self.lr!r}: must be > 0")
        if self.weight_decay < 0 or self.initial_accumulator_value < 0:
            raise ConfigError("TableConfig.weight_decay and initial_accumulator_value must be >= 0")
        if self.memory_share <= 0:
            raise ConfigError(f"TableConfig.memory_share={self.memory_share!r}: must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"TableConfig.beta1={self.beta1!r}, beta2={self.beta2!r}: must be in [0, 1)")
        if self.eps is None:
            object.__setattr__(self, "eps", _DEFAULT_EPS[opt])
        elif not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps) or self.eps < 0:
            raise ConfigError(f"TableConfig.eps={self.eps!r}: must be a finite number >= 0")
        if self.init_scale is None:
            object.__setattr__(self, "init_scale", 1.0 / math.sqrt(self.dim))
        elif not isinstance(self.init_scale, (int, float)) or not math.isfinite(self.init_scale) or self.init_scale < 0:
            raise ConfigError(f"TableConfig.init_scale={self.init_scale!r}: must be a finite number >= 0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**63:
            raise ConfigError(f"TableConfig.seed={self.seed!r}: must be an int64")
        if not isinstance(self.admit_after, int) or isinstance(self.admit_after, bool) or not (
                0 <= self.admit_after < 2**31):
            raise ConfigError(f"TableConfig.admit_after={self.admit_after!r}: must be an int >= 0")
        if self.unadmitted not in ("init", "zeros"):
            raise ConfigError(f"TableConfig.unadmitted={self.unadmitted!r}: choose 'init' or 'zeros'")
        if not isinstance(self.ttl_steps, int) or isinstance(self.ttl_steps, bool) or not 0 <= self.ttl_steps < 2**62:
            raise ConfigError(f"TableConfig.ttl_steps={self.ttl_steps!r}: must be an int >= 0 (0: no expiry)")
        if isinstance(self.ttl_seconds, bool) or not isinstance(self.ttl_seconds, (int, float)) or not (
                math.isfinite(self.ttl_seconds) and self.ttl_seconds >= 0):
            raise ConfigError(f"TableConfig.ttl_seconds={self.ttl_seconds!r}: must be a finite number >= 0 "
                              "(0: no expiry)")
        object.__setattr__(self, "ttl_seconds", float(self.ttl_seconds))
        if not isinstance(self.stochastic_rounding, bool):
            raise ConfigError(f"TableConfig.stochastic_rounding={self.stochastic_rounding!r}: must be a bool")
        if self.stochastic_rounding and self.dtype == StorageDtype.FLOAT32.value:
            raise ConfigError("TableConfig.stochastic_rounding=True needs dtype 'float16' or 'bfloat16' "
                              "(float32 rows are not rounded)")

    @property
    def expires(self) -> bool:
        """Whether rows of this table expire (``ttl_steps`` or ``ttl_seconds`` set)."""
        return self.ttl_steps > 0 or self.ttl_seconds > 0

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the stored weights."""
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (persisted with the store)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown TableConfig fields {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**dict(data))

    def layout_conflicts(self, other: TableConfig) -> list[str]:
        """Fields whose change would alter stored rows (dim, optimizer, dtype, initializer, seed)."""
        fields_ = ("dim", "optimizer", "dtype", "initializer", "init_scale", "seed", "initial_accumulator_value")
        return [f for f in fields_ if getattr(self, f) != getattr(other, f)]


_CGROUP_MEMORY_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def memory_limit_bytes(paths: Sequence[str] = _CGROUP_MEMORY_FILES) -> int | None:
    """The memory limit of this process's cgroup (a container's limit) in bytes, or None when it has none.

    Reads cgroup v2's ``memory.max``, else v1's ``memory.limit_in_bytes``.
    """
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        value = int(text)
        return value if value < _NO_LIMIT else None
    return None


def machine_memory_bytes() -> int:
    """Memory this process may use in bytes: the machine's physical memory, or its container's limit if lower.

    Default tier sizes are fractions of it, so a pod without explicit sizes fits its limit.
    """
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = memory_limit_bytes()
    return physical if limit is None else min(physical, limit)


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of a device in bytes (machine memory for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return machine_memory_bytes()


@dataclass(frozen=True)
class CacheConfig:
    """Tiers, store and placement policy of an :class:`~embcache.EmbeddingCache`.

    Args:
        hbm_bytes: bytes of the hot tier (on ``device``) shared by all tables, split by
            ``TableConfig.memory_share``; None = 1/8 of the device memory (CPU: of RAM), capped at 4 GiB.
            0 disables the tier.
        ddr_bytes: bytes of the warm tier in host memory (not pinned: copies to a GPU are staged);
            None = 1/8 of RAM (of the cgroup memory limit where lower), capped at 8 GiB. 0 disables the tier.
        path: directory of the cold-tier store (created if missing; reopened if it exists).
        store: "rocksdb" (default) or "lmdb".
        device: device of the hot tier; None = "cuda" when available, else "cpu".
        policy: "lrfu" (default: exponentially aged frequency, i.e. LFU with recency),
            "lfu" (plain counts), "lru", or a callable ``fn(freq, last, now) -> score`` (a tensor
            on any device: it is moved to the tier's).
        halflife: accesses after which a past access counts half (policy "lrfu"); None =
            40x the table's rows in memory (tuned on bench/bench_policy.py workloads).
        idle_halving: policy "lrfu": a row's score halves for every ``idle_halving`` accesses it
            is estimated to have missed since its last one (idle ticks times the access rate its
            aged frequency implies; see :mod:`embcache.policy`); ``math.inf`` turns the
            discount off (plain aged frequency). > 0.
        admission: a row from below enters a full tier only if its (sketched) frequency beats
            the victim's. Ignored by "lru".
        sketch_width: columns of the count-min sketch of non-resident rows (power of two);
            None = 8x the table's rows in memory (a power of two), at least 4096, at most 2**23.
        eviction_sample: victims are the lowest scores among ``eviction_sample`` x needed
            random resident rows (all rows when the tier is small); >= 1.
        max_batch_keys: largest accepted batch (keys per call).
        reject_nonfinite: reject gradients containing NaN or inf (default True).
        store_options: extra keyword options for the store backend.
        validate_memory: check capacities against the machine (default True).
        mrc_sample_rate: share of keys the online miss-ratio-curve estimator samples
            (:mod:`embcache.mrc`); None = automatic (about 512 rows in its smallest shadow,
            at most 1/256 of the keys), 0 = off. Policies
            "lrfu" and "lfu" only (the shadows run those).
        tune_policy: policy "lrfu" with ``halflife`` None: tune the half-life, the idle discount
            and strict admission online, by miniature simulations of a sample of the keys
            (:mod:`embcache.sim.tuner`; on the miss-ratio estimator's background thread, so it
            needs ``mrc_sample_rate`` != 0). Which rows stay in memory then depends on when
            that thread ran, so hit counts may differ between runs (the values never do);
            False keeps the fixed defaults.
        lookups_create_rows: True (default): a lookup of a key the store lacks makes its row
            (the initializer's values) and may cache it. False: it returns the table's
            ``unadmitted`` row ("init" or "zeros") and caches nothing: only rows the store
            holds enter memory, and no lookup changes what the cache holds beyond moving
            stored rows between tiers (serving mode, :mod:`embcache.server.serving`).
        expiry_interval: seconds between two sweeps of the background sweeper that deletes
            expired rows (tables with ``TableConfig.ttl_steps`` or ``ttl_seconds``); > 0.
            ``EmbeddingCache.expire_now()`` runs one sweep at once.
    """

    hbm_bytes: int | None = None
    ddr_bytes: int | None = None
    path: str = "./embcache-data"
    store: str = "rocksdb"
    device: str | None = None
    policy: str | ScoreFn = "lrfu"
    halflife: float | None = None
    idle_halving: float = 2.5
    admission: bool = True
    sketch_width: int | None = None
    eviction_sample: int = 16
    max_batch_keys: int = 1 << 24
    reject_nonfinite: bool = True
    store_options: Mapping[str, Any] = field(default_factory=dict)
    validate_memory: bool = True
    mrc_sample_rate: float | None = None
    tune_policy: bool = True
    lookups_create_rows: bool = True
    expiry_interval: float = 60.0

    def __post_init__(self) -> None:
        kind = _enum_value(StoreKind, self.store, "CacheConfig.store")
        object.__setattr__(self, "store", kind.value)
        if not callable(self.policy):
            object.__setattr__(self, "policy", _enum_value(PolicyName, self.policy, "CacheConfig.policy").value)
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"CacheConfig.device={self.device!r} is not a torch device: {exc}") from None
            if dev.type not in ("cpu", "cuda"):
                raise ConfigError(f"CacheConfig.device={self.device!r}: must be 'cpu' or 'cuda[:N]'")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ConfigError(f"CacheConfig.device={self.device!r} but CUDA is not available; use 'cpu' or None")
        for name in ("hbm_bytes", "ddr_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ConfigError(f"CacheConfig.{name}={value!r}: must be None or an int >= 0 (bytes)")
        # A flag given as a string ("false" in a server's TOML) would read as True: refuse it.
        for name in ("admission", "reject_nonfinite", "validate_memory", "tune_policy", "lookups_create_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"CacheConfig.{name}={getattr(self, name)!r}: must be a bool (True or False)")
        if not isinstance(self.store_options, Mapping):
            raise ConfigError(f"CacheConfig.store_options={self.store_options!r}: must be a mapping of option names")
        if self.halflife is not None and (not _is_real(self.halflife) or not math.isfinite(self.halflife)
                                          or self.halflife <= 0):
            raise ConfigError(f"CacheConfig.halflife={self.halflife!r}: must be None or a finite number > 0")
        if not (_is_real(self.idle_halving) and self.idle_halving > 0) or math.isnan(self.idle_halving):
            raise ConfigError(f"CacheConfig.idle_halving={self.idle_halving!r}: must be a number > 0 (math.inf: off)")
        if self.sketch_width is not None and (not _is_int(self.sketch_width) or self.sketch_width < 16
                                              or self.sketch_width & (self.sketch_width - 1)):
            raise ConfigError(f"CacheConfig.sketch_width={self.sketch_width!r}: must be a power of two >= 16")
        if not _is_int(self.eviction_sample) or self.eviction_sample < 1:
            raise ConfigError(f"CacheConfig.eviction_sample={self.eviction_sample!r}: must be an int >= 1")
        if self.mrc_sample_rate is not None and (not _is_real(self.mrc_sample_rate)
                                                 or not 0.0 <= self.mrc_sample_rate <= 1.0):
            raise ConfigError(f"CacheConfig.mrc_sample_rate={self.mrc_sample_rate!r}: must be None or in [0, 1]")
        if not _is_real(self.expiry_interval) or not (
                math.isfinite(self.expiry_interval) and self.expiry_interval > 0):
            raise ConfigError(f"CacheConfig.expiry_interval={self.expiry_interval!r}: must be a finite number > 0")
        if not _is_int(self.max_batch_keys) or self.max_batch_keys < 1:
            raise ConfigError(f"CacheConfig.max_batch_keys={self.max_batch_keys!r}: must be an int >= 1")
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError(f"CacheConfig.path={self.path!r}: must be a non-empty path")
        object.__setattr__(self, "path", os.fspath(self.path))
        if self.validate_memory:
            self._validate_memory()

    @property
    def torch_device(self) -> torch.device:
        """The device of the hot tier, with its index for CUDA ("cuda" -> "cuda:<current>").

        Tensors made on ``"cuda"`` report ``cuda:0``, and ``torch.device("cuda") != "cuda:0"``: the
        index makes the cache's device compare equal to the devices of the tensors it returns.
        """
        dev = torch.device(self.device if self.device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def resolved_hbm_bytes(self) -> int:
        """HBM bytes after applying the default."""
        if self.hbm_bytes is not None:
            return self.hbm_bytes
        return min(device_memory_bytes(self.torch_device) // 8, 4 << 30)

    def resolved_ddr_bytes(self) -> int:
        """DDR bytes after applying the default."""
        if self.ddr_bytes is not None:
            return self.ddr_bytes
        return min(machine_memory_bytes() // 8, 8 << 30)

    def _validate_memory(self) -> None:
        ram = machine_memory_bytes()
        hbm, ddr = self.resolved_hbm_bytes(), self.resolved_ddr_bytes()
        dev = self.torch_device
        if dev.type == "cuda":
            total = device_memory_bytes(dev)
            if hbm > total * 0.9:
                raise ConfigError(
                    f"CacheConfig.hbm_bytes={hbm} exceeds 90% of {dev}'s {total} bytes; lower it")
            host = ddr
        else:
            host = hbm + ddr  # the hot tier lives in host memory too
        if host > ram * 0.9:
            raise ConfigError(
                f"CacheConfig hbm_bytes+ddr_bytes={host} bytes of host memory exceed 90% of this "
                f"machine's {ram} bytes; lower them or pass validate_memory=False")
