"""The streaming writer of ``mcore.checkpoint.stream``: its sink cuts writes into pieces and CRC32s
them in a thread as it goes; CPU views are saved without a copy and without the rest of their
storage. (Saves through it: ``test_checkpoint*.py``; manifest CRC32s checked against re-reads:
``test_checkpoint_integrity.py``, and at DP2 in ``test_checkpoint_size.py``.)"""

from __future__ import annotations

import concurrent.futures
import errno
import io
import time
import zlib

import pytest
import torch

from megatron_empg.mcore.checkpoint import stream as checkpoint_stream

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("checksums", [True, False])
def test_sink_writes_every_byte_in_pieces_and_its_crc32(tmp_path, monkeypatch, checksums):
    monkeypatch.setattr(checkpoint_stream, "WRITE_CHUNK", 1000)
    pieces = []

    class Recording(io.FileIO):
        def write(self, b):
            pieces.append(len(b))
            return super().write(b)

    data = [b"header", torch.arange(3000, dtype=torch.int32).numpy().tobytes(), bytearray(b"x" * 999), b""]
    data.append(memoryview(torch.arange(700, dtype=torch.float64).numpy()))  # not bytes-shaped: cast to bytes
    path = tmp_path / "file"
    with concurrent.futures.ThreadPoolExecutor(1) as pool, Recording(path, "wb") as f:
        sink = checkpoint_stream._Sink(f, pool if checksums else None)
        for chunk in data:
            assert sink.write(chunk) == memoryview(chunk).nbytes
    written = path.read_bytes()
    assert written == b"".join(bytes(memoryview(chunk).cast("B")) for chunk in data)
    assert sink.tell() == sink.size == len(written)
    assert sink.crc32 == (zlib.crc32(written) if checksums else 0)
    assert pieces == [6] + [1000] * 12 + [999] + [1000] * 5 + [600]  # no piece over WRITE_CHUNK; b"" writes none


def test_a_failed_write_waits_for_the_crc32_of_its_buffer(tmp_path, monkeypatch):
    """The CRC32 thread reads the caller's buffer (torch frees it once ``write`` is left): a write
    that fails (a full disk) must not raise before that thread is done with it."""
    finished, crc32 = [], zlib.crc32

    def slow_crc32(data, value):
        time.sleep(0.3)
        finished.append(len(data))
        return crc32(data, value)

    class FullDisk(io.FileIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_stream.zlib, "crc32", slow_crc32)
    with concurrent.futures.ThreadPoolExecutor(1) as pool, FullDisk(tmp_path / "file", "wb") as f:
        with pytest.raises(OSError, match="No space"):
            checkpoint_stream._Sink(f, pool).write(b"x" * 100)
        assert finished == [100]  # done before the error came out, not after


def test_a_cpu_view_gets_a_storage_of_its_own_bytes_without_a_copy():
    flat = torch.arange(100, dtype=torch.bfloat16)
    view = flat[10:30].view(4, 5)
    own = checkpoint_stream._own_storage(view)
    assert own.data_ptr() == view.data_ptr() and own.untyped_storage().nbytes() == 40
    assert own.dtype == view.dtype and own.shape == view.shape and torch.equal(own, view)
    saved, cloned = io.BytesIO(), io.BytesIO()
    torch.save(own, saved)
    torch.save(view.clone(), cloned)
    assert len(saved.getvalue()) == len(cloned.getvalue()) < len(_saved_bytes(view))  # not the 200-byte storage
    assert torch.equal(torch.load(io.BytesIO(saved.getvalue())), view)
    whole = torch.arange(10.0)
    assert checkpoint_stream._own_storage(whole) is whole
    strided = flat.view(10, 10)[:, 0]
    assert checkpoint_stream._own_storage(strided) is strided  # not contiguous: left to torch.save


def _saved_bytes(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()
