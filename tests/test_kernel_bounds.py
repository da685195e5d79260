"""The bounds check of the kernels' memory accesses in Triton's interpreter (``tests/kernel_bounds.py``), on small
kernels whose accesses are known: it stops each one that leaves its launch's tensors, before it touches memory,
and passes masked lanes, views and atomics that stay inside. ``tests/conftest.py`` installs it for every test, so
every fused kernel the tests run is checked."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import kernel_bounds  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or triton.__version__ != "3.6.0",
    reason="the bounds check wraps Triton 3.6.0's interpreter",
)


@triton.jit
def _copy(x_ptr, y_ptr, n_load, n_store, B: tl.constexpr):
    o = tl.arange(0, B)
    v = tl.load(x_ptr + o, mask=o < n_load, other=0.0)
    tl.store(y_ptr + o, v, mask=o < n_store)


@triton.jit
def _add_at(x_ptr, i, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.atomic_add(x_ptr + i + o, 1.0, mask=o < 2)


@triton.jit
def _misaligned(x_ptr, y_ptr):
    p = (x_ptr.to(tl.pointer_type(tl.int8)) + 2).to(tl.pointer_type(tl.float32))
    tl.store(y_ptr, tl.load(p))


@triton.jit
def _scalar(x_ptr, y_ptr, i):
    tl.store(y_ptr, tl.load(x_ptr + i))


@triton.jit
def _block_copy(x_ptr, y_ptr, n, CHECK: tl.constexpr, B: tl.constexpr):
    src = tl.make_block_ptr(x_ptr, shape=(n,), strides=(1,), offsets=(0,), block_shape=(B,), order=(0,))
    dst = tl.make_block_ptr(y_ptr, shape=(n,), strides=(1,), offsets=(0,), block_shape=(B,), order=(0,))
    if CHECK:
        tl.store(dst, tl.load(src, boundary_check=(0,), padding_option="zero"), boundary_check=(0,))
    else:
        tl.store(dst, tl.load(src))


@triton.jit
def _descriptor_copy(x_desc, y_ptr, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y_ptr + o, x_desc.load([0]))


def _stopped(launch) -> str:
    with pytest.raises(Exception) as info:
        launch()
    assert "OutOfBounds" in repr(info.value), repr(info.value)
    return str(info.value)


def test_the_check_is_installed_for_the_tests():
    assert kernel_bounds.install()  # conftest installed it: installing again is a no-op that says so
    assert getattr(triton.runtime.interpreter.GridExecutor, "_slake_bounds", False)


def test_a_load_one_element_past_its_tensor_is_stopped():
    x, y = torch.arange(8.0), torch.zeros(8)
    message = _stopped(lambda: _copy[(1,)](x, y, 9, 8, B=16))
    assert "_copy: load" in message and "'x_ptr'" in message and "1 of 9 active lanes outside it" in message
    _copy[(1,)](x, y, 8, 8, B=16)  # masked lanes past the end are not accesses
    assert torch.equal(y, x)


def test_a_store_past_a_view_is_stopped_before_it_writes():
    buffer = torch.zeros(12)
    view = buffer[2:10]  # the kernel gets the view: the buffer's other elements are not its to write
    x = torch.ones(8)
    message = _stopped(lambda: _copy[(1,)](x, view, 8, 9, B=16))
    assert "_copy: store" in message and "'y_ptr'" in message
    assert buffer.sum() == 0  # stopped before any lane was written
    _copy[(1,)](x, view, 8, 8, B=16)
    assert buffer.tolist() == [0.0, 0.0] + [1.0] * 8 + [0.0, 0.0]


def test_a_load_before_its_tensor_and_a_scalar_access_are_stopped():
    x, y = torch.arange(8.0)[1:], torch.zeros(1)
    _stopped(lambda: _scalar[(1,)](x, y, -1))
    _stopped(lambda: _scalar[(1,)](x, y, 7))
    _scalar[(1,)](x, y, 6)
    assert y.item() == 7.0


def test_atomics_are_checked():
    x = torch.zeros(4)
    _stopped(lambda: _add_at[(1,)](x, 3, B=4))  # lanes 3 and 4: 4 is past the end
    _add_at[(1,)](x, 2, B=4)
    assert x.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_a_misaligned_access_is_stopped():
    x, y = torch.arange(4.0), torch.zeros(1)
    assert "misaligned" in _stopped(lambda: _misaligned[(1,)](x, y))


def test_spans_follow_sizes_and_strides():
    base = torch.zeros(4, 6)
    span = kernel_bounds.tensor_span("t", base.t()[1:3])  # columns 1 and 2 of every row, read transposed
    assert span.end - span.start == ((2 - 1) * 1 + (4 - 1) * 6 + 1) * 4
    assert span.start == base.data_ptr() + 4
    empty = kernel_bounds.tensor_span("e", base[:, :0])
    assert empty.end == empty.start
    broadcast = kernel_bounds.tensor_span("b", torch.zeros(3).expand(5, 3))  # stride 0: the three elements
    assert broadcast.end - broadcast.start == 12


def test_launches_on_other_devices_are_not_checked():
    assert kernel_bounds.launch_spans(["x"], [torch.zeros(2, device="meta")]) is None
    spans = kernel_bounds.launch_spans(["x", "n", "pair"], [torch.zeros(2), 3, (torch.zeros(1), torch.zeros(2))])
    assert [s.name for s in spans] == ["x", "pair[0]", "pair[1]"]


def test_block_pointers_and_tensor_descriptors_are_checked():
    x, y = torch.arange(6.0), torch.zeros(6)
    _block_copy[(1,)](x, y, 6, CHECK=True, B=8)  # the block's last two lanes are outside its shape: masked
    assert torch.equal(y, x)
    assert "_block_copy: load" in _stopped(lambda: _block_copy[(1,)](x, y, 6, CHECK=False, B=8))
    from triton.tools.tensor_descriptor import TensorDescriptor

    x, y = torch.arange(8.0), torch.zeros(8)
    _descriptor_copy[(1,)](TensorDescriptor.from_tensor(x, [8]), y, B=8)  # its loads address the base tensor
    assert torch.equal(y, x)
