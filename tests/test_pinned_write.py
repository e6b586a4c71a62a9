"""Writes through pinned memory (kvroute/backend/pinned_write.py), on this CPU.

The page-locked buffer and the copy kernel need CUDA, which this machine lacks: here
`HostWriter` stands in for them (an ordinary buffer; the "kernel" copies the bytes of
each piece its plan names, by address and length, as the CUDA kernel does).
Everything else is the real code: the header, how arrays are cut into pieces and
parts, the order of copies and file writes. The CUDA kernel itself is checked on a
GPU by the last test."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import orjson
import pytest

from kvroute.backend import diskfile, pinned, pinned_write
from tests.test_pinned import HostStaging


class HostWriter(pinned_write.Writer):
    """A pinned_write.Writer with an ordinary buffer and a host copy for the kernel,
    which also checks that the bytes a launch put in the buffer are still there when
    they go to the file (no later part refilled that half first)."""

    launches = 0

    def _open(self) -> None:
        if self._host is None:
            self._host = np.zeros(self.nbytes, dtype=np.uint8)
            self._device = self._host.ctypes.data
            self.copied: list[tuple[int, bytes]] = []
            self.flushed = 0

    def warm(self) -> None:
        super().warm()
        if self._host is not None:
            self.copied = []  # the warm-up's probe goes to no file

    def _flush(self, fd, outs, start, nbytes) -> None:
        for at, data in self.copied:
            if start <= at < start + nbytes:
                assert bytes(self._host[at:at + len(data)]) == data, "a half refilled before its write"
        self.copied = [c for c in self.copied if not start <= c[0] < start + nbytes]
        self.flushed += 1
        return super()._flush(fd, outs, start, nbytes)

    def kernel(self):
        def launch(inputs, grid, threadgroup, output_shapes, output_dtypes):
            HostWriter.launches += 1
            plan = np.array(inputs[0]).astype(np.uint64)
            n = pinned_write.PIECES
            assert grid[1] == n and len(inputs) == n + 1
            for y in range(n):
                size = int(plan[2 * n + y])
                if size:
                    src = np.array(inputs[1 + y])[int(plan[n + y]):int(plan[n + y]) + size]
                    at = int(plan[y]) - self._device
                    assert 0 <= at and at + size <= self.nbytes
                    self._host[at:at + size] = src
                    self.copied.append((at, src.tobytes()))
            return [mx.zeros((1,), dtype=mx.uint32)]
        return launch


def warmed(nbytes: int = pinned_write.WRITE_BYTES) -> HostWriter:
    w = HostWriter(nbytes)
    w.warm()
    assert w.works()
    return w


def arrays() -> dict:
    """Several dtypes and shapes, a scalar, an empty array, one that is not
    row-contiguous, sizes that are not multiples of 16 bytes."""
    base = mx.random.normal((4, 6, 10)).astype(mx.float32)
    return {
        "k0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16),
        "v0": mx.random.normal((2, 4, 32, 16)).astype(mx.float16),
        "odd": mx.arange(13, dtype=mx.uint8),
        "offset": mx.array(7, dtype=mx.int32),
        "empty": mx.zeros((0, 4)),
        "strided": base[:, ::2, 3:],
        "flags": mx.array([True, False, True]),
        "wide": mx.arange(9, dtype=mx.int64) * (1 << 40),
    }


def same_as_saved(path: Path, want: dict) -> bool:
    got = mx.load(str(path))
    if set(got) != set(want):
        return False
    return all(got[k].dtype == a.dtype and got[k].shape == a.shape and mx.array_equal(got[k], a).item()
               for k, a in want.items())


def test_a_saved_file_reads_back_as_its_arrays_and_metadata(tmp_path):
    want = arrays()
    path = tmp_path / "f.safetensors"
    assert warmed().save(path, want, {"kvroute_block": '{"key": "x"}'})
    assert same_as_saved(path, want)
    _, meta = mx.load(str(path), return_metadata=True)
    assert meta == {"kvroute_block": '{"key": "x"}'}


def test_a_file_larger_than_the_buffer_goes_through_it_in_parts(tmp_path):
    """Halves of 256 bytes: a tensor several halves long is cut across them, and no
    half is refilled before its bytes are in the file (the stand-in checks). The
    sums taken on the way are the file's (its final name carries them)."""
    want = {"big": mx.arange(1000, dtype=mx.float32), **arrays()}
    path = tmp_path / "f.safetensors"
    w = warmed(nbytes=512)
    done = w.save(path, want, {"m": "1"})
    assert w.flushed > 8
    assert same_as_saved(path, want)
    assert done == diskfile.summed(path.read_bytes())


def test_tensors_start_on_16_byte_boundaries_where_a_pinned_restore_takes_them(tmp_path):
    """Whatever the metadata's length: the restore's copy kernel takes a file whose
    tensors all lie on 16-byte boundaries (theirs sizes are), and gives it back whole."""
    paths = []
    for i in range(5):
        block = {"k0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16),
                 "v0": mx.random.normal((2, 4, 32, 16)).astype(mx.bfloat16)}
        paths.append(tmp_path / f"b{i}.safetensors")
        assert warmed().save(paths[-1], block, {"kvroute_block": "x" * i})
        head = paths[-1].read_bytes()
        assert (8 + int.from_bytes(head[:8], "little")) % pinned.ALIGN == 0
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as readers:
        got = HostStaging().load([pinned.File(p, p.stat().st_size) for p in paths], readers)
    for path, arrays_ in zip(paths, got):
        assert arrays_ is not None and same_as_saved(path, arrays_)


def test_header_lists_what_mlx_save_safetensors_lists(tmp_path):
    want = arrays()
    mine, theirs = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert warmed().save(mine, want, {"m": "1"})
    mx.save_safetensors(str(theirs), want, {"m": "1"})

    def table(path: Path) -> dict:
        data = path.read_bytes()
        head = orjson.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        return {k: (v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
                for k, v in head.items() if k != "__metadata__"}
    assert table(mine) == table(theirs)


def test_on_cuda_the_disk_writer_saves_through_it_and_a_restore_answers_exactly(tmp_path, monkeypatch):
    """A conversation's blocks and record written on "CUDA" (forced on this CPU) go
    through the writer's buffer, not through copies read by MLX's writer, and restore
    (through pinned memory, stood in for) as the conversation's own KV."""
    from tests.test_disk import make_tier, restore
    from tests.test_disk_blocks import conversation, kv_of
    from tests.test_paged import same_cache
    from kvroute.backend.store import Store
    from tests.harness import wait_until

    monkeypatch.setattr(diskfile, "on_cuda", lambda: True)
    monkeypatch.setattr(pinned, "Staging", HostStaging)
    monkeypatch.setattr(pinned_write, "Writer", HostWriter)
    mlx_saves: list = []
    real_save = mx.save_safetensors
    monkeypatch.setattr(mx, "save_safetensors", lambda *a, **kw: mlx_saves.append(a[0]) or real_save(*a, **kw))
    tier, _ = make_tier(tmp_path)
    assert tier.blocks.writer.works()  # warmed when the tier opened
    HostWriter.launches = 0
    store = Store(budget_bytes=1 << 30)
    store.listeners.append(tier.on_store_event)
    store.insert("m", conversation(0), kv_of(conversation(0)), "finish", chain=[0])
    wait_until(lambda: tier.index, 30, what="the conversation written")
    assert HostWriter.launches >= 11 and not mlx_saves  # ten blocks and the record
    tier.close()
    again, _ = make_tier(tmp_path)
    assert same_cache(restore(again, conversation(0) + [1]).cache, kv_of(conversation(0)))
    again.close()


def test_where_cuda_cannot_give_pinned_memory_the_writer_says_so_once_and_saves_do_not_go_through_it(
        tmp_path, caplog):
    w = pinned_write.Writer()  # conftest: no CUDA runtime here
    w.warm()
    w.warm()
    assert w.failed and not w.works()
    assert sum("writes through pinned memory failed" in r.getMessage() for r in caplog.records) == 1
    assert not w.save(tmp_path / "f.safetensors", arrays(), {})
    assert not (tmp_path / "f.safetensors").exists()


def test_a_copy_mlx_cannot_run_now_leaves_the_file_to_the_other_way(tmp_path):
    """A launch that fails (MLX out of memory for it, say) fails this save only: the
    caller saves the file another way, over what was written, and later saves still
    go through the buffer."""
    class Tight(HostWriter):
        refuse = True

        def kernel(self):
            launch = super().kernel()

            def maybe(**kw):
                if Tight.refuse:
                    raise RuntimeError("[malloc] Unable to allocate 4 bytes.")
                return launch(**kw)
            return maybe

    w = Tight()
    Tight.refuse = False
    w.warm()
    Tight.refuse = True
    want = arrays()
    path = tmp_path / "f.safetensors"
    assert not w.save(path, want, {})
    diskfile.save(path, want, {}, w)  # the other way (here: MLX's writer)
    assert same_as_saved(path, want) and w.works()
    Tight.refuse = False
    assert w.save(path, want, {}) and same_as_saved(path, want)


def test_a_copy_that_gives_other_bytes_fails_the_path_at_warm_up():
    class Broken(HostWriter):
        def kernel(self):
            def launch(inputs, **kw):
                return [mx.zeros((1,), dtype=mx.uint32)]  # copies nothing
            return launch

    w = Broken()
    w.warm()
    assert w.failed and not w.works()


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                    reason="needs a CUDA GPU (pinned memory and the real copy kernel)")
def test_on_a_gpu_the_copy_kernel_writes_what_mlx_writes(tmp_path, monkeypatch):
    from kvroute.core import accel

    monkeypatch.setattr(pinned, "cuda_runtime", accel.cuda_runtime)
    w = pinned_write.Writer(nbytes=1 << 12)  # in parts
    w.warm()
    assert w.works()
    want = {"big": mx.random.normal((3, 1000)).astype(mx.bfloat16), **arrays()}
    mx.eval(list(want.values()))
    path = tmp_path / "f.safetensors"
    done = w.save(path, want, {"m": "1"})
    assert same_as_saved(path, want) and done == diskfile.summed(path.read_bytes())
