"""A CPU-only stand-in for one CUDA device, so that the ``device.type == "cuda"`` branches run in CI.

CI has no GPU (docs/gpu.md says what ran on one). Under :func:`fake_cuda`, ``torch.cuda.is_available()``
is True and a tensor "on cuda:0" is a :class:`FakeCudaTensor`: a wrapper subclass that reports
``device == cuda:0`` and holds its data in a CPU tensor (``.elem``). A
:class:`~torch.overrides.TorchFunctionMode` sees every torch call and runs it on the CPU data,
wrapping results that would be on the GPU; it enforces what a real GPU enforces and counts what
a real GPU makes costly:

* **Device mixing raises**, as CUDA does: one op taking a fake-CUDA tensor and a real CPU tensor
  of one or more dimensions (0-dim CPU tensors are scalars, allowed as in torch). Indexing a
  CUDA tensor with CPU indices is allowed (torch copies them), as are the copy functions.
* **``.numpy()`` of a fake-CUDA tensor raises** (TypeError, torch's message).
* **Host syncs are counted** (:attr:`FakeCuda.events`, per thread): ``item``/``__bool__``/
  ``__int__``/``__float__``/``__index__``, ``tolist``, ``nonzero``/``argwhere``/one-argument
  ``where``, ``unique``/``unique_consecutive``, ``masked_select``, ``repeat_interleave`` without
  ``output_size``, boolean-mask indexing, blocking device-to-host copies, and ``synchronize``
  of the device, a stream or an event. Host-to-device copies are counted apart (``"h2d"``),
  and so are non-blocking device-to-host copies (``"d2h_async"``, not a sync).
* **Stand-ins**: ``torch.cuda.is_available/current_device/device_count/get_device_properties/
  set_device/synchronize``, ``Stream``, ``Event``, ``current_stream``, ``default_stream``,
  ``stream(...)`` (a per-thread current stream), pinned memory (``pin_memory=True``,
  ``Tensor.pin_memory()``, ``is_pinned()``, tracked by storage; :meth:`FakeCuda.pinned_bytes` is
  what is alive), ``torch.cuda.empty_cache`` and the pinned cache's ``torch._C._host_emptyCache``
  (recorded as ``"mem"`` events) and ``torch.Generator(device="cuda")``
  (a CPU generator marked CUDA; a random op on the fake device with a CPU generator, or the other
  way round, raises as torch does).
* **Threads**: torch function modes are per thread, so every ``threading.Thread`` started while
  the stand-in is active enters it too (the cache's prefetch worker, store readers, MRC sampler).

What it cannot do faithfully (tests must not rely on these):

* **Autograd**: torch's engine aborts the process on a CUDA-typed tensor in a CPU build, and the
  mode runs ops on the unwrapped CPU data, so no graph reaches the wrappers. Run forwards under
  ``torch.no_grad()``; backward paths are tested on the CPU device.
* **Asynchrony**: every op runs at once on the host, in program order. Streams and events only
  record what was asked (:attr:`FakeStream.waited`); a race between streams cannot show, and a
  non-blocking copy's data is valid at once.
* **Numerics**: results are the CPU kernels' (CUDA's atomics in ``index_add_`` are not
  reproduced), and memory (the caching allocators, pinned rounding, what a GPU holds) is not
  modeled: only live pinned tensors are counted, and the calls that empty the caches recorded.
* Ops reached below the torch-function level (inside C++ composite ops) are not seen by the
  mode; ``FakeCudaTensor.__torch_dispatch__`` runs them on the CPU data without counting.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FakeCuda", "FakeCudaTensor", "FakeEvent", "FakeStream", "fake_cuda", "is_fake_cuda"]

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
_MIX = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


class FakeCudaTensor(torch.Tensor):
    """A tensor reporting ``cuda:0`` whose data is the CPU tensor ``elem``."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # the mode does the work

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FakeCudaTensor:
        assert type(elem) is torch.Tensor and elem.device.type == "cpu", type(elem)
        r = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            device=CUDA, requires_grad=False)
        r.elem = elem
        return r  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeCudaTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Fallback for ops below the torch-function level: run on the data, rewrap.
        kwargs = kwargs or {}
        has_fake = any(isinstance(a, FakeCudaTensor) for a in tree_flatten((args, kwargs))[0])
        a, k = tree_map(_unwrap, (args, kwargs))
        if isinstance(k.get("device"), torch.device) and k["device"].type == "cuda":
            k["device"] = CPU
        out = func(*a, **k)
        return tree_map(_wrap, out) if has_fake else out


def _unwrap(x: Any) -> Any:
    return x.elem if isinstance(x, FakeCudaTensor) else x


def _wrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor) and x.device.type == "cpu":
        return FakeCudaTensor(x)
    return x


def is_fake_cuda(x: Any) -> bool:
    """Whether ``x`` is a tensor on the stand-in device."""
    return isinstance(x, FakeCudaTensor)


def _is_cuda(device: Any) -> bool:
    if device is None or isinstance(device, torch.dtype):
        return False
    if isinstance(device, int):
        return True  # a bare int is a CUDA ordinal in torch
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class FakeEvent:
    """``torch.cuda.Event`` stand-in: records where it was recorded; ``synchronize`` is a host sync."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded_on: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on = stream if stream is not None else _STATE.current_stream()

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream if stream is not None else _STATE.current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _STATE.note("sync", "event.synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """``torch.cuda.Stream`` stand-in: keeps the events and streams it was told to wait for."""

    def __init__(self, device: Any = None, priority: int = 0, name: str = "side") -> None:
        self.device = CUDA
        self.name = name
        self.waited: list[FakeEvent | FakeStream] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: FakeStream) -> None:
        self.waited.append(stream)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _STATE.note("sync", "stream.synchronize")

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class _FakeGenerator(torch.Generator):
    """A CPU generator standing for a CUDA one (``torch.Generator(device="cuda")``)."""

    fake_cuda = True

    def __new__(cls, device: Any = "cpu") -> _FakeGenerator:
        return super().__new__(cls, "cpu")  # type: ignore[call-arg]


@dataclass
class _Props:
    name: str = "FakeCuda (CPU stand-in)"
    total_memory: int = 80 << 30
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132


@dataclass
class FakeCuda:
    """The active stand-in: what it counted, per thread. See the module docstring."""

    stand_in = True  # tests/realcuda.py's RealCuda has the same interface on a real GPU
    events: list[tuple[int, str, str]] = field(default_factory=list)  # (thread id, kind, what)
    default_stream: FakeStream = field(default_factory=lambda: FakeStream(name="default"))
    _local: threading.local = field(default_factory=threading.local)
    _pinned: dict[int, weakref.ref[Any]] = field(default_factory=dict)  # storage ptr -> storage
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- counting ------------------------------------------------------------------------------
    def note(self, kind: str, what: str) -> None:
        with self._lock:
            self.events.append((threading.get_ident(), kind, what))

    def counts(self, kind: str | None = None, thread: int | None = None) -> Counter[str]:
        """What was counted (``{what: n}``) of ``kind`` ("sync", "h2d", "d2h_async", "mem"), in ``thread``
        (default: the calling thread)."""
        thread = threading.get_ident() if thread is None else thread
        with self._lock:
            return Counter(w for t, k, w in self.events if t == thread and (kind is None or k == kind))

    @contextlib.contextmanager
    def count(self) -> Iterator[_Window]:
        """Count what the calling thread does inside the block: ``with fc.count() as c: ...; c.syncs``."""
        with self._lock:
            start = len(self.events)
        win = _Window(self, threading.get_ident(), start)
        try:
            yield win
        finally:
            with self._lock:
                win.stop = len(self.events)

    # -- streams and pinned memory ---------------------------------------------------------------
    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def stream(self, s: FakeStream | None) -> Iterator[FakeStream | None]:
        prev = getattr(self._local, "stream", None)
        if s is not None:
            self._local.stream = s
        try:
            yield s
        finally:
            self._local.stream = prev

    def mark_pinned(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        with self._lock:
            self._pinned[storage.data_ptr()] = weakref.ref(t)
        return t

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory alive now (tensors made pinned and not yet freed). Freed
        blocks are not cached here, unlike torch's pinned allocator: this is what is in use."""
        with self._lock:
            live = [r() for r in self._pinned.values()]
        return sum(t.untyped_storage().nbytes() for t in live if t is not None)

    def is_pinned(self, t: torch.Tensor) -> bool:
        if isinstance(t, FakeCudaTensor) or t.numel() == 0:
            return False
        ref = self._pinned.get(t.untyped_storage().data_ptr())
        return ref is not None and ref() is not None


@dataclass
class _Window:
    fc: FakeCuda
    thread: int
    start: int
    stop: int | None = None

    def _events(self, kind: str) -> list[str]:
        with self.fc._lock:
            stop = len(self.fc.events) if self.stop is None else self.stop
            return [w for t, k, w in self.fc.events[self.start:stop] if t == self.thread and k == kind]

    @property
    def syncs(self) -> list[str]:
        """Host syncs the thread made in the window, in order (what each was)."""
        return self._events("sync")

    @property
    def h2d(self) -> list[str]:
        """Host-to-device copies the thread made in the window."""
        return self._events("h2d")


_STATE: FakeCuda = FakeCuda()  # replaced by each fake_cuda()

# torch calls whose result says something about the data: the host waits for the device
_SYNC_FUNCS = {
    torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.tolist, torch.nonzero, torch.Tensor.nonzero, torch.argwhere,
    torch.Tensor.argwhere, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
    torch.Tensor.unique_consecutive, torch.masked_select, torch.Tensor.masked_select,
    torch.Tensor.__format__, torch.Tensor.__repr__,
}
_RANDOM = {torch.randint, torch.rand, torch.randn, torch.randperm, torch.Tensor.random_, torch.Tensor.uniform_,
           torch.Tensor.normal_, torch.multinomial, torch.Tensor.bernoulli_, torch.bernoulli}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.index_put,
             torch.Tensor.index_put}


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


class _Mode(TorchFunctionMode):
    def __init__(self, state: FakeCuda) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        st = self.state
        name = _name(func)
        if name == "__get__":  # attributes: the wrapper's metadata (device cuda:0, shape, dtype)
            if args and isinstance(args[0], FakeCudaTensor) and getattr(func, "__self__", None) is not None:
                attr = getattr(func.__self__, "__name__", "")
                if attr == "is_cuda":
                    return True
                if attr in ("data",):
                    return args[0]
            return func(*args, **kwargs)
        flat = tree_flatten((args, kwargs))[0]
        fakes = [x for x in flat if isinstance(x, FakeCudaTensor)]
        if func is torch.Tensor.numpy and fakes:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_,
                    torch.Tensor.pin_memory, torch.Tensor.is_pinned, torch.Tensor.record_stream):
            return self._transfer(func, args, kwargs)
        if func is torch._has_compatible_shallow_copy_type:  # Module.to asks; a wrapper never is
            return False
        # 1. checks
        if fakes:
            if func not in _INDEXING and not name.endswith("_like"):
                for x in flat:
                    if (isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor) and x.dim() > 0
                            and x.device.type == "cpu"):
                        raise RuntimeError(f"{_MIX} (fake cuda: {name})")
            if func in _SYNC_FUNCS or (func is torch.where and len(args) + len(kwargs) == 1):
                st.note("sync", name)
            elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs:
                st.note("sync", name)
            elif func in _INDEXING and any(isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.dim() > 0
                                           for x in tree_flatten(args[1])[0]):
                st.note("sync", f"{name}[bool mask]")
            elif func in _INDEXING and any(isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor)
                                           and x.dim() > 0 for x in tree_flatten(args[1:])[0]):
                st.note("h2d", f"{name}[cpu index]")
        # 2. where does the result live?
        device = kwargs.get("device")
        to_cuda = _is_cuda(device) if "device" in kwargs and device is not None else bool(fakes)
        if "device" in kwargs and to_cuda:
            kwargs["device"] = CPU
        pin = bool(kwargs.pop("pin_memory", False))
        if func in _RANDOM:
            gen = kwargs.get("generator")
            on_cuda = to_cuda
            if gen is not None and bool(getattr(gen, "fake_cuda", False)) != on_cuda:
                raise RuntimeError(f"Expected a '{'cuda' if on_cuda else 'cpu'}' device type for generator but "
                                   f"found '{'cpu' if on_cuda else 'cuda'}'")
        a, k = tree_map(_unwrap, (args, kwargs))
        out = func(*a, **k)
        if pin:
            tree_map(lambda x: st.mark_pinned(x) if isinstance(x, torch.Tensor) else x, out)
        if not to_cuda:
            return out
        # in-place ops return their input: give back the same wrapper
        by_elem = {id(f.elem): f for f in fakes}

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and id(x) in by_elem:
                return by_elem[id(x)]
            return _wrap(x)
        return tree_map(wrap, out)

    def _transfer(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        st = self.state
        src = args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.is_pinned:
            return st.is_pinned(src)
        if func is torch.Tensor.pin_memory:
            if isinstance(src, FakeCudaTensor):
                raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
            return st.mark_pinned(src.clone())
        if func is torch.Tensor.copy_:
            dst, source = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            d_fake, s_fake = isinstance(dst, FakeCudaTensor), isinstance(source, FakeCudaTensor)
            if s_fake and not d_fake and source.numel() > 0:  # an empty copy moves nothing
                self._d2h(non_blocking and st.is_pinned(dst), "copy_")
            elif d_fake and not s_fake and source.numel() > 0:
                st.note("h2d", "copy_" + ("" if non_blocking and st.is_pinned(source) else " (pageable)"))
            _unwrap(dst).copy_(_unwrap(source))
            return dst
        device: Any = None
        dtype: torch.dtype | None = None
        rest = list(args[1:])
        # to(device, dtype, non_blocking, copy) / to(dtype, non_blocking, copy) / to(other, ...);
        # cuda(device, non_blocking); cpu()
        bools = [x for x in rest if isinstance(x, bool)]
        non_blocking = bool(kwargs.get("non_blocking", bools[0] if bools else False))
        copy = bool(kwargs.get("copy", bools[1] if len(bools) > 1 else False))
        if func is torch.Tensor.cpu:
            device = CPU
        elif func is torch.Tensor.cuda:
            device = CUDA
        else:
            for x in rest:
                if isinstance(x, torch.dtype):
                    dtype = x
                elif isinstance(x, torch.Tensor):
                    device, dtype = x.device, x.dtype
                elif not isinstance(x, bool) and x is not None:
                    device = x
            device = kwargs.get("device", device)
            dtype = kwargs.get("dtype", dtype)
        s_fake = isinstance(src, FakeCudaTensor)
        data = _unwrap(src)
        if device is None:
            target_cuda = s_fake
        else:
            target_cuda = _is_cuda(device)
        out = data.to(dtype=dtype, copy=copy) if dtype is not None else (data.clone() if copy else data)
        if s_fake and not target_cuda:
            if data.numel() > 0:
                self._d2h(non_blocking, "to(cpu)")
            if out is data:
                out = data.clone()  # a real copy: the host tensor must not alias device memory
            return out
        if not s_fake and target_cuda:
            if data.numel() > 0:  # an empty tensor copies nothing
                st.note("h2d", "to(cuda)" + ("" if non_blocking and st.is_pinned(data) else " (pageable)"))
            return FakeCudaTensor(out.clone() if out is data else out)
        if s_fake:
            return src if out is data else FakeCudaTensor(out)
        return out

    def _d2h(self, async_ok: bool, what: str) -> None:
        if async_ok:
            self.state.note("d2h_async", what)
        else:
            self.state.note("sync", f"d2h {what}")


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """Run the block (and the threads it starts) as if one CUDA device were present; see the module docstring."""
    global _STATE
    state = FakeCuda()
    prev_state, _STATE = _STATE, state
    cuda = torch.cuda
    patches: list[tuple[Any, str, Any]] = [
        (cuda, "is_available", lambda: True),
        (cuda, "is_initialized", lambda: True),
        (cuda, "current_device", lambda: 0),
        (cuda, "device_count", lambda: 1),
        (cuda, "set_device", lambda device: None),
        (cuda, "get_device_properties", lambda device=None: _Props()),
        (cuda, "synchronize", lambda device=None: state.note("sync", "cuda.synchronize")),
        (cuda, "empty_cache", lambda: state.note("mem", "empty_cache")),
        (torch._C, "_host_emptyCache", lambda: state.note("mem", "host_empty_cache")),
        (cuda, "Stream", FakeStream),
        (cuda, "Event", FakeEvent),
        (cuda, "current_stream", lambda device=None: state.current_stream()),
        (cuda, "default_stream", lambda device=None: state.default_stream),
        (cuda, "stream", state.stream),
        (torch, "Generator", _generator),
    ]
    missing = object()  # torch._C._host_emptyCache is in CUDA builds only
    saved = [(obj, attr, getattr(obj, attr, missing)) for obj, attr, _ in patches]
    run = threading.Thread.run

    @functools.wraps(run)
    def run_under_stand_in(self: threading.Thread) -> None:
        with _Mode(state):
            run(self)

    for obj, attr, value in patches:
        setattr(obj, attr, value)
    threading.Thread.run = run_under_stand_in  # type: ignore[method-assign]
    try:
        with _Mode(state):
            yield state
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]
        for obj, attr, value in saved:
            if value is missing:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)
        _STATE = prev_state


_REAL_GENERATOR = torch.Generator


class _GeneratorMeta(type(torch.Generator)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _REAL_GENERATOR)


class _generator(_REAL_GENERATOR, metaclass=_GeneratorMeta):
    """``torch.Generator`` while the stand-in is active: ``device="cuda"`` gives a :class:`_FakeGenerator`."""

    def __new__(cls, device: Any = "cpu") -> Any:  # type: ignore[misc]
        return _FakeGenerator() if _is_cuda(device) else _REAL_GENERATOR(device)


def assert_syncs(window: _Window, at_most: int, what: str = "") -> None:
    """Fail with the list of syncs when the window made more than ``at_most``."""
    syncs = window.syncs
    assert len(syncs) <= at_most, f"{what}: {len(syncs)} host syncs (budget {at_most}): {syncs}"

