"""Device names resolve to the devices tensors report, so a tensor's device can be compared with a setting's."""

from __future__ import annotations

import pytest
import torch

from diffspec.devices import DeviceTimer, HostCopy, PinnedStaging, host_int64, resolve_device
from diffspec.errors import InvalidRequest


@pytest.mark.parametrize("name, index", [("cuda", 0), ("auto", 0), ("cuda:1", 1)])
def test_a_gpu_comes_back_with_its_index(monkeypatch, name, index):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device(name) == torch.device("cuda", index)


def test_the_cpu_and_unknown_names():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(InvalidRequest, match="unknown device"):
        resolve_device("tpu:7")


def test_on_the_cpu_a_host_copy_is_the_tensor_and_a_timer_the_wall_clock():
    values = torch.arange(6.0)
    assert HostCopy(values).get() is values
    timer = DeviceTimer(torch.device("cpu"))
    timer.start()
    torch.ones(64, 64) @ torch.ones(64, 64)
    timer.stop()
    assert 0.0 < timer.seconds() < 60.0


def test_staged_uploads_are_int64_on_the_device():
    staging = PinnedStaging(torch.device("cpu"))
    assert torch.equal(staging.upload([3, 1, 2]), torch.tensor([3, 1, 2]))
    assert staging.upload([]).shape == (0,) and staging.upload([]).dtype == torch.int64
    assert staging.upload().shape == (0,)


PARTS = [  # parts of one upload: lists, ranges (written as aranges), empty ones, a stepped range (as a list)
    ([4, 9], range(100, 105), [], range(7, 7), [2**40]),
    (range(0, 70_000), list(range(5)), range(3, 12, 4), [], [9, 2**40]),
]


@pytest.mark.parametrize("parts", PARTS)
def test_an_upload_of_parts_holds_them_one_after_another(parts):
    staging = PinnedStaging(torch.device("cpu"))
    assert staging.upload(*parts).tolist() == [value for part in parts for value in part]


@pytest.mark.parametrize("values", [[], [0], [5, -3, 2**62], list(range(70_000))])
def test_host_int64_holds_python_ints_in_order(values):
    for given in (values, iter(values)):  # a list, or any iterable (a batch's chained token lists)
        packed = host_int64(given)
        assert packed.dtype == torch.int64 and packed.device.type == "cpu" and packed.tolist() == values


@pytest.mark.gpu
def test_on_a_gpu_staged_uploads_reuse_read_buffers_and_never_wait_for_the_device():
    device = resolve_device("cuda")
    staging = PinnedStaging(device)
    first = staging.upload(list(range(10)))
    torch.cuda.synchronize(device)
    second = staging.upload(list(range(100, 130)))  # the first was read: its buffer is reused
    assert staging.num_buffers == 1
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        busy = busy @ busy  # the stream is busy: the next upload's copy waits behind this
    third = staging.upload([7, 8])
    fourth = staging.upload([9])  # the third's copy is still queued: a second buffer, no wait
    assert staging.num_buffers == 2
    grown = staging.upload(list(range(1000)))
    assert first.tolist() == list(range(10)) and second.tolist() == list(range(100, 130))
    assert third.tolist() == [7, 8] and fourth.tolist() == [9]
    assert grown.tolist() == list(range(1000)) and grown.device.type == "cuda"
    for parts in PARTS:  # into the pinned buffer part by part
        assert staging.upload(*parts).tolist() == [value for part in parts for value in part]


@pytest.mark.gpu
def test_on_a_gpu_a_host_copy_waits_for_its_work_and_a_timer_spans_it():
    device = resolve_device("cuda")
    values = torch.randn(2048, 2048, device=device)
    timer = DeviceTimer(device)
    timer.start()
    product = values @ values
    timer.stop()
    copy = HostCopy(product[:4, :4])
    assert torch.equal(copy.get(), product[:4, :4].cpu())
    assert product.device == device and 0.0 < timer.seconds() < 10.0
