"""Restores through pinned memory (kvroute/backend/pinned.py), on this CPU.

The page-locked buffer and the copy kernel need CUDA, which this machine lacks: here
`HostStaging` stands in for them (an ordinary buffer; the "kernel" copies the bytes
each launch's plan points at, by address and length, as the CUDA kernel does).
Everything else is the real code: which files it takes, where their bytes go in the
buffer, reading them in parts, and the arrays made of them. The CUDA kernel itself is
checked on a GPU against MLX's reader, file for file (BENCHMARKS.md)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvroute.backend import pinned


class HostStaging(pinned.Staging):
    """A pinned.Staging with an ordinary buffer and a host copy for the kernel, which
    also checks that no byte a launch reads changes before its copies are waited for
    (the GPU reads the buffer until then)."""

    launches = 0

    def _open(self) -> None:
        if self._host is None:
            self._host = np.zeros(self.nbytes, dtype=np.uint8)
            self._device = self._host.ctypes.data
            self.reading: list[tuple[int, bytes]] = []

    def _wait(self, arrays) -> None:
        for at, seen in self.reading:
            assert bytes(self._host[at:at + len(seen)]) == seen, "the buffer changed under a copy"
        self.reading.clear()
        super()._wait(arrays)

    def kernel(self):
        def launch(inputs, grid, threadgroup, output_shapes, output_dtypes):
            HostStaging.launches += 1
            plan = np.array(inputs[0]).astype(np.uint64)
            assert grid[1] == pinned.BATCH and len(output_shapes) == pinned.BATCH
            outs = []
            for i, shape in enumerate(output_shapes):
                words = int(plan[pinned.BATCH + i])
                at = int(plan[i]) - self._device
                if words == 0:
                    outs.append(mx.zeros(shape, dtype=mx.uint32))
                    continue
                assert at % pinned.ALIGN == 0 and shape == (words * pinned.ALIGN // 4,)
                self.reading.append((at, bytes(self._host[at:at + words * pinned.ALIGN])))
                outs.append(mx.array(self._host[at:at + words * pinned.ALIGN].view(np.uint32)))
            return outs
        return launch


def header_of(path: Path) -> tuple[dict, int]:
    import orjson

    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = orjson.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return header, 8 + n


def write_files(folder: Path, count: int) -> list[Path]:
    """Files like block files (a key and a value array) and others: several dtypes
    and shapes, none a multiple of the others."""
    paths = []
    for i in range(count):
        arrays = {"k0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16),
                  "v0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16)}
        if i % 3 == 1:
            arrays["k1"] = mx.random.normal((3, 8)).astype(mx.float32)
            arrays["v1"] = mx.arange(48, dtype=mx.uint8).reshape(3, 16)
        path = folder / f"b{i}.safetensors"
        mx.save_safetensors(str(path), arrays, {"kvroute_block": "{}"})
        paths.append(path)
    return paths


def load(staging: pinned.Staging, paths: list[Path]) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    files = [pinned.plan(p, *header_of(p)) for p in paths]
    assert all(f is not None for f in files)
    with ThreadPoolExecutor(4) as readers:
        return staging.load(files, readers)


def same_as_mlx_reader(paths: list[Path], got: list[dict]) -> bool:
    for path, arrays in zip(paths, got):
        want = mx.load(str(path))
        if set(want) != set(arrays):
            return False
        for name, a in want.items():
            b = arrays[name]
            if a.dtype != b.dtype or a.shape != b.shape or not mx.array_equal(a, b).item():
                return False
    return True


def test_files_come_back_as_mlx_reads_them(tmp_path):
    paths = write_files(tmp_path, 40)  # 40 files, 106 tensors: 7 launches of 16
    HostStaging.launches = 0
    got = load(HostStaging(), paths)
    assert same_as_mlx_reader(paths, got)
    assert HostStaging.launches == -(-sum(len(mx.load(str(p))) for p in paths) // pinned.BATCH)


def test_a_restore_larger_than_the_buffer_goes_through_it_in_parts(tmp_path):
    paths = write_files(tmp_path, 12)
    size = max(p.stat().st_size for p in paths)
    staging = HostStaging(nbytes=3 * size)  # three files at a time at most
    parts = staging._parts([pinned.plan(p, *header_of(p)) for p in paths])
    assert len(parts) >= 4 and all(sum(f.nbytes for f in part) <= 3 * size for part in parts)
    assert same_as_mlx_reader(paths, load(staging, paths))


def test_files_it_cannot_copy_in_16_byte_words_are_left_to_mlxs_reader(tmp_path):
    odd = tmp_path / "odd.safetensors"
    mx.save_safetensors(str(odd), {"a": mx.arange(3, dtype=mx.uint8), "b": mx.arange(5, dtype=mx.int32)})
    assert pinned.plan(odd, *header_of(odd)) is None  # 3 and 20 bytes
    empty = tmp_path / "empty.safetensors"
    mx.save_safetensors(str(empty), {"a": mx.zeros((0, 4))})
    assert pinned.plan(empty, *header_of(empty)) is None
    even = write_files(tmp_path, 1)[0]
    assert pinned.plan(even, *header_of(even)) is not None


def test_a_file_cut_short_fails_the_load(tmp_path):
    from kvroute.backend.diskfile import BadRecord

    paths = write_files(tmp_path, 3)
    files = [pinned.plan(p, *header_of(p)) for p in paths]
    paths[1].write_bytes(paths[1].read_bytes()[:-100])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as readers, pytest.raises(BadRecord):
        HostStaging().load(files, readers)


def test_a_file_larger_than_the_buffer_is_left_to_mlxs_reader(tmp_path):
    path = write_files(tmp_path, 1)[0]
    assert pinned.plan(path, *header_of(path), limit=1024) is None
    assert pinned.plan(path, *header_of(path), limit=1 << 20) is not None


def test_one_read_failing_lets_the_buffer_go_only_when_every_read_is_over(tmp_path):
    """A read that fails must not leave others writing into the buffer the next
    restore fills (its files would then fail their checksums, and be deleted)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    paths = write_files(tmp_path, 8)
    files = [pinned.plan(p, *header_of(p)) for p in paths]
    done, real_read = [], HostStaging._read

    class Slow(HostStaging):
        def _read(self, f):
            if f is files[0]:
                raise OSError("unreadable")
            time.sleep(0.05)
            real_read(self, f)
            done.append(threading.get_ident())

    with ThreadPoolExecutor(4) as readers, pytest.raises(OSError):
        Slow().load(files, readers)
    assert len(done) == 7  # the other reads had all ended when load raised


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                    reason="needs a CUDA GPU (pinned memory and the real copy kernel)")
def test_on_a_gpu_the_copy_kernel_gives_what_mlxs_reader_does(tmp_path, monkeypatch):
    from kvroute.core import accel

    monkeypatch.setattr(pinned, "cuda_runtime", accel.cuda_runtime)
    paths = write_files(tmp_path, 40)
    staging = pinned.Staging(nbytes=1 << 16)  # in parts
    staging.warm()
    assert not staging.failed
    assert same_as_mlx_reader(paths, load(staging, paths))


def test_where_cuda_cannot_give_pinned_memory_the_staging_says_so_once(caplog):
    staging = pinned.Staging()  # conftest: no CUDA runtime here
    staging.warm()
    staging.warm()
    assert staging.failed
    assert sum("pinned memory failed" in r.getMessage() for r in caplog.records) == 1
