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
    (the GPU reads the buffer until then), and that a load waits for all of them."""

    launches = 0

    def _open(self) -> None:
        if self._host is None:
            self._host = np.zeros(self.nbytes, dtype=np.uint8)
            self._device = self._host.ctypes.data
            self.reading: list[tuple[int, bytes, object]] = []

    def load(self, *args, **kwargs):
        out = super().load(*args, **kwargs)
        assert not self.reading, "a load returned before its copies were waited for"
        return out

    def _wait(self, arrays) -> None:
        waited = {id(a) for a in arrays}
        for at, seen, out in [r for r in self.reading if id(r[2]) in waited]:
            assert bytes(self._host[at:at + len(seen)]) == seen, "the buffer changed under a copy"
        self.reading = [r for r in self.reading if id(r[2]) not in waited]
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
                outs.append(mx.array(self._host[at:at + words * pinned.ALIGN].view(np.uint32)))
                self.reading.append((at, bytes(self._host[at:at + words * pinned.ALIGN]), outs[-1]))
            return outs
        return launch


def write_files(folder: Path, count: int) -> list[Path]:
    """Files like block files (a key and a value array) and others: several dtypes
    and shapes, none a multiple of the others, headers of several lengths."""
    paths = []
    for i in range(count):
        arrays = {"k0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16),
                  "v0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16)}
        if i % 3 == 1:
            arrays["k1"] = mx.random.normal((3, 8)).astype(mx.float32)
            arrays["v1"] = mx.arange(48, dtype=mx.uint8).reshape(3, 16)
        path = folder / f"b{i}.safetensors"
        mx.save_safetensors(str(path), arrays, {"kvroute_block": "x" * (i % 5)})
        paths.append(path)
    return paths


def files_of(paths: list[Path]) -> list[pinned.File]:
    return [pinned.File(p, p.stat().st_size) for p in paths]


def load(staging: pinned.Staging, paths: list[Path]) -> list[dict | None]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as readers:
        return staging.load(files_of(paths), readers)


def same_as_mlx_reader(paths: list[Path], got: list[dict]) -> bool:
    for path, arrays in zip(paths, got):
        want = mx.load(str(path))
        if arrays is None or set(want) != set(arrays):
            return False
        for name, a in want.items():
            b = arrays[name]
            if a.dtype != b.dtype or a.shape != b.shape or not mx.array_equal(a, b).item():
                return False
    return True


def test_files_come_back_as_mlx_reads_them(tmp_path):
    """Whatever their header's length (a file's tensors are moved onto a 16-byte
    boundary in the buffer where the last file's did not fit it)."""
    paths = write_files(tmp_path, 40)  # 40 files, 106 tensors: 7 launches of 16
    lengths = {int.from_bytes(p.read_bytes()[:8], "little") % pinned.ALIGN for p in paths}
    assert len(lengths) > 1
    HostStaging.launches = 0
    got = load(HostStaging(), paths)
    assert same_as_mlx_reader(paths, got)
    assert HostStaging.launches == -(-sum(len(mx.load(str(p))) for p in paths) // pinned.BATCH)


@pytest.mark.parametrize("slots", [2, 3])
def test_a_restore_larger_than_the_buffer_goes_through_it_in_parts(tmp_path, slots):
    """Parts read into the buffer's slots at once, each slot read into again once the
    copies of its part are over: the stand-in checks that no slot is refilled before
    its copies were waited for."""
    paths = write_files(tmp_path, 30)
    largest = max(pinned._slot(p.stat().st_size) for p in paths)
    staging = HostStaging(nbytes=slots * pinned.FILES_A_SLOT * largest)
    got_slots, size, parts = staging._layout(files_of(paths))
    assert got_slots == slots and len(parts) > 2 * slots
    assert sorted(i for part in parts for i, _ in part) == list(range(30))
    assert all(at + p.stat().st_size <= size for part in parts for i, at in part
               for p in [paths[i]])
    assert same_as_mlx_reader(paths, load(staging, paths))


def test_the_buffer_holds_up_to_eight_parts_with_room_for_four_of_the_largest_file():
    files = [pinned.File(Path(f"{i}"), 1_900_000) for i in range(250)]  # a 7B model's blocks
    slots, size, parts = pinned.Staging()._layout(files)
    assert (slots, size) == (pinned.SLOTS, pinned.STAGING_BYTES // pinned.SLOTS)
    assert len(parts) == -(-250 // (size // pinned._slot(1_900_000)))
    big = [pinned.File(Path("a"), 40 << 20), pinned.File(Path("b"), 1 << 20)]
    assert pinned.Staging()._layout(big)[0] == 2  # no room for four such files in less


def test_the_next_part_is_read_while_this_parts_copies_are_launched(tmp_path):
    """A restore in parts keeps its readers busy: the next part's reads are under way
    when this part's copies are launched (the launches, one kernel per batch and a
    view per tensor, took ~15 ms of an 8k-token 7B restore on an H100, the readers
    idle). The stand-in's first launch waits for a read of the second part."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    paths = write_files(tmp_path, 12)
    size = max(p.stat().st_size for p in paths)
    staging = HostStaging(nbytes=2 * 3 * (size + 2 * pinned.ALIGN))
    files = files_of(paths)
    second = {files[i].path for i, _ in staging._layout(files)[2][1]}
    reading_second = threading.Event()

    def fill(f, view):
        if f.path in second:
            reading_second.set()
        return pinned.plain_fill(f, view)

    launch, overlapped = staging.kernel(), []

    def first_waits(*args, **kwargs):
        if not overlapped:
            overlapped.append(reading_second.wait(10))
        return launch(*args, **kwargs)

    staging.kernel = lambda: first_waits
    with ThreadPoolExecutor(4) as readers:
        got = staging.load(files, readers, fill)
    assert overlapped == [True]
    assert same_as_mlx_reader(paths, got)


def test_small_tensors_not_in_16_byte_words_are_made_on_the_host(tmp_path):
    """A record's scalars (3 and 20 bytes here), an empty tensor (a tail of no tokens)
    and a bfloat16 tensor out of step with 16-byte words, beside tensors the kernel
    copies: each file comes back as MLX's reader gives it, only the even tensors
    launched."""
    odd = tmp_path / "odd.safetensors"
    mx.save_safetensors(str(odd), {"a": mx.arange(3, dtype=mx.uint8), "b": mx.arange(5, dtype=mx.int32),
                                   "c": mx.random.normal((4, 16)).astype(mx.bfloat16),
                                   "d": mx.random.normal((3, 3)).astype(mx.bfloat16)})
    empty = tmp_path / "empty.safetensors"
    mx.save_safetensors(str(empty), {"a": mx.zeros((0, 4)), "b": mx.zeros((1, 0, 8), dtype=mx.bfloat16)})
    even = write_files(tmp_path, 2)
    HostStaging.launches = 0
    paths = [even[0], odd, empty, even[1]]
    got = load(HostStaging(), paths)
    assert same_as_mlx_reader(paths, got)
    assert HostStaging.launches == 1  # even[0] 2, odd 1 ("c"), even[1] 2: one launch of 16


def test_a_file_with_more_than_a_little_to_make_on_the_host_is_left_to_the_caller(tmp_path):
    """Arrays made from host bytes land in managed memory on CUDA, which the GPU pulls
    page by page: a file with more than `HOST_BYTES` of tensors the kernel cannot copy
    is the caller's to load."""
    big = tmp_path / "big.safetensors"
    n = pinned.HOST_BYTES // 3 + 1  # three tensors of an odd number of bytes
    mx.save_safetensors(str(big), {f"t{i}": mx.zeros((n,), dtype=mx.uint8) for i in range(3)})
    even = write_files(tmp_path, 1)
    got = load(HostStaging(), [big, even[0]])
    assert got[0] is None and same_as_mlx_reader(even, got[1:])


def with_header(path: Path, out: Path, change) -> Path:
    """A copy of a safetensors file whose tensor table `change` edited."""
    import orjson

    data = path.read_bytes()
    end = 8 + int.from_bytes(data[:8], "little")
    header = orjson.loads(data[8:end])
    change(header)
    raw = orjson.dumps(header)
    raw += b" " * (-len(raw) % 8)
    out.write_bytes(len(raw).to_bytes(8, "little") + raw + data[end:])
    return out


def test_a_tensor_table_that_does_not_match_its_bytes_is_left_to_the_caller(tmp_path):
    """The kernel must never read past a file's slot: a table whose tensors run past
    the file, or whose shapes do not fit their bytes, gets no copy."""
    good = write_files(tmp_path, 1)[0]

    def past_the_end(h):
        h["v0"]["data_offsets"][1] += 1024

    def wrong_shape(h):
        h["k0"]["shape"][0] += 1

    def no_offsets(h):
        del h["k0"]["data_offsets"]

    bad = [with_header(good, tmp_path / f"{f.__name__}.safetensors", f)
           for f in (past_the_end, wrong_shape, no_offsets)]
    got = load(HostStaging(), [good, *bad])
    assert same_as_mlx_reader([good], got[:1]) and got[1:] == [None, None, None]


def test_a_file_cut_short_fails_the_load(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from kvroute.backend.diskfile import BadRecord

    paths = write_files(tmp_path, 3)
    files = files_of(paths)
    paths[1].write_bytes(paths[1].read_bytes()[:-100])
    with ThreadPoolExecutor(2) as readers, pytest.raises(BadRecord):
        HostStaging().load(files, readers)


def test_a_file_larger_than_a_half_of_the_buffer_is_left_to_the_caller(tmp_path):
    paths = write_files(tmp_path, 2)
    big = tmp_path / "big.safetensors"
    mx.save_safetensors(str(big), {"a": mx.zeros((1 << 15,), dtype=mx.uint8)})
    staging = HostStaging(nbytes=1 << 16)  # a half of 32 KiB, which the file's tensor fills
    assert not staging.fits(big.stat().st_size) and staging.fits(paths[0].stat().st_size)
    got = load(staging, [paths[0], big, paths[1]])
    assert got[1] is None and same_as_mlx_reader(paths, [got[0], got[2]])


def test_one_read_failing_lets_the_buffer_go_only_when_every_read_is_over(tmp_path):
    """A read that fails must not leave others writing into the buffer the next
    restore fills (its files would then fail their checksums, and be deleted)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    paths = write_files(tmp_path, 8)
    files = files_of(paths)
    done = []

    def fill(f, view):
        if f is files[0]:
            raise OSError("unreadable")
        time.sleep(0.05)
        done.append(threading.get_ident())
        return pinned.plain_fill(f, view)

    with ThreadPoolExecutor(4) as readers, pytest.raises(OSError):
        HostStaging().load(files, readers, fill)
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


def test_readers_shut_down_under_a_load_are_said_apart_from_a_failure(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    readers = ThreadPoolExecutor(2)
    readers.shutdown()
    staging = HostStaging()
    with pytest.raises(pinned.ReadersClosed):
        staging.load(files_of(write_files(tmp_path, 2)), readers)


def test_where_cuda_cannot_give_pinned_memory_the_staging_says_so_once(caplog):
    staging = pinned.Staging()  # conftest: no CUDA runtime here
    staging.warm()
    staging.warm()
    assert staging.failed
    assert sum("restores through pinned memory failed" in r.getMessage() for r in caplog.records) == 1
