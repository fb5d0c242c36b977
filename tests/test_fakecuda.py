"""The CUDA stand-in (tests/fakecuda.py) catches what a real GPU would: device mixes, numpy of
device tensors, host syncs; and it gets out of the way afterwards."""

from __future__ import annotations

import threading

import pytest
import torch

from .fakecuda import FakeCudaTensor, fake_cuda, is_fake_cuda


def test_tensors_report_cuda_and_compute_on_host_data() -> None:
    with fake_cuda():
        assert torch.cuda.is_available() and torch.cuda.current_device() == 0
        x = torch.arange(10, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda and is_fake_cuda(x)
        y = torch.where(x > 4, x * 2, -1).view(2, 5)
        assert y.device.type == "cuda" and y.shape == (2, 5)
        assert torch.equal(y.cpu(), torch.where(torch.arange(10) > 4, torch.arange(10) * 2, -1).view(2, 5))
        x.index_copy_(0, torch.tensor([1], device="cuda"), torch.tensor([7], device="cuda"))
        assert x.cpu()[1] == 7
        assert x.new_zeros(2).device.type == "cuda" and torch.empty_like(x, device="cpu").device.type == "cpu"
    assert not torch.cuda.is_available() or not isinstance(torch.zeros(1, device="cuda"), FakeCudaTensor)


def test_mixing_with_host_tensors_and_numpy_raise() -> None:
    with fake_cuda():
        x = torch.arange(4, device="cuda")
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([x, torch.arange(2)])
        with pytest.raises(RuntimeError, match="same device"):
            x.index_select(0, torch.tensor([0, 1]))
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert torch.equal((x + torch.tensor(1)).cpu(), torch.arange(1, 5))  # a 0-dim host tensor is a scalar
        assert torch.equal(x[torch.tensor([0, 2])].cpu(), torch.tensor([0, 2]))  # host indices are allowed


def test_host_syncs_and_copies_are_counted_per_thread() -> None:
    with fake_cuda() as fc:
        x = torch.arange(10, device="cuda")
        with fc.count() as c:
            y = x[x > 3]  # boolean mask: nonzero underneath
            torch.unique(y)
            int(y.sum())
            y.tolist()
            torch.nonzero(y)
            x.cpu()
            x + 1  # no sync
        assert c.syncs == ["__getitem__[bool mask]", "unique", "__int__", "tolist", "nonzero", "d2h to(cpu)"]
        pinned = torch.empty(10, dtype=torch.int64, pin_memory=True)
        assert pinned.is_pinned() and not torch.zeros(1).is_pinned()
        with fc.count() as c:
            pinned.copy_(x, non_blocking=True)  # into pinned memory: asynchronous
            torch.arange(3).to("cuda", non_blocking=True)  # pageable: counted as such
            pinned.to("cuda", non_blocking=True)
            threading.Thread(target=lambda: bool(x.sum())).start()  # another thread's sync is its own
        assert c.syncs == [] and c.h2d == ["to(cuda) (pageable)", "to(cuda)"]


def test_threads_streams_events_and_generators() -> None:
    with fake_cuda():
        seen: list[torch.device] = []
        t = threading.Thread(target=lambda: seen.append(torch.zeros(1, device="cuda").device))
        t.start()
        t.join()
        assert seen == [torch.device("cuda", 0)]
        side, event = torch.cuda.Stream(), torch.cuda.Event()
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
            event.record()
        torch.cuda.current_stream().wait_event(event)
        assert event.recorded_on is side and torch.cuda.current_stream().waited == [event]
        g = torch.Generator(device="cuda")
        g.manual_seed(0)
        assert torch.randint(0, 9, (4,), device="cuda", generator=g).device.type == "cuda"
        with pytest.raises(RuntimeError, match="generator"):
            torch.randint(0, 9, (4,), device="cuda", generator=torch.Generator())
        with pytest.raises(RuntimeError, match="generator"):
            torch.randint(0, 9, (4,), generator=g)
