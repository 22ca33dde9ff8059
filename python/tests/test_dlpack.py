"""Tensors cross through DLPack without copies: what the native side sees is the producer's own
memory, dtype and shape; non-contiguous tensors are refused."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import shardsync


def info(t):
    return shardsync.native().tensor_info(t)


def test_import_does_not_import_torch():
    import subprocess

    code = "import sys, shardsync; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "dtype,name",
    [(np.float32, "F32"), (np.float16, "F16"), (np.float64, "F64"), (np.int64, "I64"),
     (np.int32, "I32"), (np.int8, "I8"), (np.uint8, "U8"), (np.bool_, "BOOL")],
)
def test_numpy_zero_copy(dtype, name):
    a = np.zeros((3, 5), dtype=dtype)
    i = info(a)
    assert i["data_ptr"] == a.ctypes.data
    assert i["dtype"] == name and i["shape"] == [3, 5] and i["device"] == "cpu"
    assert i["nbytes"] == a.nbytes


def test_numpy_views_and_offsets():
    a = np.arange(40, dtype=np.float32).reshape(8, 5)
    rows = a[2:5]  # contiguous row slab with a byte offset
    assert info(rows)["data_ptr"] == a.ctypes.data + 2 * 5 * 4
    with pytest.raises(shardsync.InvalidArgumentError, match="not C-contiguous"):
        info(a[:, 1:3])
    with pytest.raises(shardsync.InvalidArgumentError, match="not C-contiguous"):
        info(a.T)
    col = a[:, :1]  # (8, 1): stride of the unit dim is irrelevant, dim 0 stride is 5 -> refused
    with pytest.raises(shardsync.InvalidArgumentError):
        info(col)


def test_readonly_numpy_falls_back_to_buffer_protocol():
    a = np.arange(6, dtype=np.float32)
    a.setflags(write=False)
    i = info(a)
    assert i["data_ptr"] == a.ctypes.data and i["dtype"] == "F32"


def test_unsupported_inputs():
    with pytest.raises(shardsync.InvalidArgumentError, match="unsupported DLPack dtype"):
        info(np.zeros(3, dtype=np.complex64))
    with pytest.raises(shardsync.InvalidArgumentError, match="neither __dlpack__"):
        info(object())
    with pytest.raises(shardsync.InvalidArgumentError, match="at most 4"):
        info(np.zeros((1, 1, 1, 1, 2), dtype=np.float32))


def test_checksum_reads_the_producers_bytes():
    C = shardsync.native()
    a = np.arange(1000, dtype=np.float32)
    assert C.checksum(a) == C.checksum(a.copy())
    b = a.copy()
    b[500] += 1
    assert C.checksum(a) != C.checksum(b)



def test_torch_zero_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    i = info(t)
    assert i["data_ptr"] == t.data_ptr() and i["shape"] == [3, 4] and i["dtype"] == "F32"
    bf = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert info(bf)["dtype"] == "BF16" and info(bf)["data_ptr"] == bf.data_ptr()
    p = torch.nn.Parameter(torch.ones(2, 3))  # requires grad: detached, same storage
    assert info(p)["data_ptr"] == p.data_ptr()
    with pytest.raises(shardsync.InvalidArgumentError, match="not C-contiguous"):
        info(t.t())
    assert info(t[1:])["data_ptr"] == t.data_ptr() + 4 * 4
