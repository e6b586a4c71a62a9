"""One prompt-cache entry as a file of the disk tier.

A record is a safetensors file laid out as mlx-lm's `save_prompt_cache` lays it out
(MLX's own format, so any layer cache mlx-lm can save round-trips, windows and
recurrent states included). Its string metadata carries one more key, `kvroute`: a JSON
object with the exact token ids the state holds, the model fingerprint, the
format version, the cache scope, the advertised prefix chain, whether the entry
can be trimmed, and the chain keys of the shared blocks (diskblocks.py) that hold
its first tokens' full-attention KV (its own full-attention layers then hold only
the tokens after them). The file's name ends with two checksums: one of its header (the
8-byte length and the JSON header: metadata, token ids, tensor table) and one of
the whole file, header included, so a flipped token id in the header is as damaged
as a flipped tensor byte.

Reading a record's header never touches its tensors: a safetensors file starts
with an 8-byte length and a JSON header (tensor offsets and the metadata), so a
restart re-indexes a directory of any size quickly. The header also tells the
file's exact length, which finds a truncated file without reading it; the header's
checksum finds a damaged header at the same time, the whole file's checksum finds
corrupted tensor bytes when a record is loaded. Anything that does not check out
raises `BadRecord` and is never handed to the model.

On CUDA the writer also puts a device checksum of the tensors (devsum.py) in the
metadata, `dsum`: a restore there loads the file once, through MLX's reader into
device memory, and checks the arrays where they landed (the header is checked on
the host, by its own checksum). A file without one (written on another platform,
or by an older version) is read and checked on the host first, then loaded.

Durability: `write` fsyncs the temporary file before renaming it into place and
the directory after, so after a power loss a record is whole or absent (and a
damaged one is still found by its checksums). With fsync off (`--disk-fsync never`)
the kernel writes it back in its own time: a power loss may lose the newest
records or leave them damaged, and the checksums drop those.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import xxhash

log = logging.getLogger("kvroute.backend.disk")

FORMAT_VERSION = 2  # 2: the checksums cover the header too (1: tensor bytes only)
SUFFIX = ".kvr.safetensors"
TMP_SUFFIX = ".tmp.safetensors"  # mx.save_safetensors insists on the extension
_MAX_HEADER = 64 << 20


class BadRecord(Exception):
    """A file that is partial, corrupt, foreign or of another format version."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # short, for the metric label


@dataclass
class Record:
    name: str  # file name inside the directory
    tokens: np.ndarray  # int32, exactly the tokens whose state the file holds
    scope: str | None
    chain: list[int]
    trimmable: bool
    exit_path: str
    size: int  # bytes on disk
    data_offset: int  # where the tensor bytes start
    checksum: str  # xxh3_64 of the whole file (header and tensor bytes), hex
    created: float = 0.0
    model: str = ""
    hits: int = field(default=0, compare=False)
    # Chain keys of the shared blocks (diskblocks.py) holding its first tokens' full-
    # attention KV, in order; its own file holds the rest. Empty: the file holds all.
    blocks: list[int] = field(default_factory=list)
    dsum: str = ""  # the tensors' device checksum (devsum.py); empty where none was made


def fingerprint(model_path: str | Path) -> str:
    """Identifies the weights a state was computed with: the config, and each weight
    file's name, size and the xxh3 of its first and last MiB (a changed, retrained or
    re-quantized model differs there; hashing whole files would cost a full read of
    the weights at every start)."""
    root = Path(model_path)
    h = hashlib.sha256()
    config = root / "config.json"
    h.update(config.read_bytes() if config.exists() else b"")
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(xxhash.xxh3_64(f.read(1 << 20)).digest())
            f.seek(max(0, size - (1 << 20)))
            h.update(xxhash.xxh3_64(f.read(1 << 20)).digest())
    return h.hexdigest()[:32]


# Test-only: called with each step of a write ("tmp_written", "tmp_synced",
# "renamed", "dir_synced"; the two `_synced` right after their fsync, and only when
# there was one); tests set it in a backend process to SIGKILL it there, or count.
crash_point: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if crash_point is not None:
        crash_point(name)


def write(directory: Path, stem: str, cache: list[Any], meta: dict,
          fsync: bool = True, writer: Any = None,
          device_sum: Callable[[int], bool] | None = None) -> tuple[str, int]:
    """Write `cache` under a temporary name, fsync it, rename it into place and fsync
    the directory, so a reader (or a restart after a crash or a power loss) never sees
    half a record; fsync=False leaves both fsyncs to the kernel's write-back (a crash
    of the process loses nothing, a power loss may). The final name carries the
    checksums (a header cannot hold the checksum of a file it starts). On CUDA the
    tier's `writer` (pinned_write.Writer) saves it where it can (`save`), and a
    device checksum goes in unless `device_sum`, asked with the tensors' bytes, says
    none is needed (a file restored through pinned memory is checked by its xxh3
    sums). Returns the file's name and size."""
    tmp = directory / (stem + TMP_SUFFIX)
    try:
        done = save(tmp, *_flatten(cache, meta, device_sum), writer)
        _step("tmp_written")
        os.chmod(tmp, 0o600)
        with open(tmp, "rb") as f:
            if done is None:  # just written: its sums from the page cache
                done = summed(f.read())
            if fsync:
                os.fsync(f.fileno())
                _step("tmp_synced")
        name = f"{stem}.{done.head_sum}.{done.file_sum}{SUFFIX}"
        os.replace(tmp, directory / name)
        _step("renamed")
        if fsync:
            _fsync_dir(directory)
            _step("dir_synced")
        return name, done.size
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only folder: a restart drops it as partial
            pass
        raise


def _flatten(cache: list[Any], meta: dict,
             device_sum: Callable[[int], bool] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors and string metadata of a record, as mlx-lm's `save_prompt_cache`
    makes them (`_rebuild` reads them back): the layers' states flattened, scalars
    stored as arrays and listed, and our `kvroute` JSON first, with the tensors'
    device checksum where a restore will want it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    scalars: list[Any] = [""]  # never empty: tree_flatten would drop it

    def as_array(item: tuple[str, Any]) -> tuple[str, Any]:
        key, data = item
        if isinstance(data, mx.array):
            return item
        if isinstance(data, (int, float, bool)):
            scalars.append((key, "scalar"))
            return key, mx.array(data)
        if isinstance(data, str):
            scalars.append((key, "string"))
            return key, mx.array([ord(c) for c in data])
        if data is None:
            scalars.append((key, "none"))
            return key, mx.array([])
        raise ValueError(f"Model state is not serializable: {data}")

    arrays = dict(map(as_array, tree_flatten([c.state for c in cache])))
    wanted = device_sum is None or device_sum(sum(a.nbytes for a in arrays.values()))
    (dsum,) = sums_to_write([arrays]) if wanted else (None,)
    if dsum:
        meta = {**meta, "dsum": dsum}
    classes = [type(c).__name__ for c in cache]
    metadata = dict(tree_flatten([{"kvroute": orjson.dumps(meta).decode()}, classes, scalars]))
    return arrays, metadata


def sums_to_write(files: list[dict[str, Any]]) -> list[str | None]:
    """The device checksum each file of arrays carries: on CUDA, where a restore
    checks a file on the device (elsewhere none: restores there check the xxh3)."""
    sums = device_sums(files) if on_cuda() and files else None
    return list(sums) if sums is not None else [None] * len(files)


STAGED_CLEAR = 64 << 20  # bytes of device copies past which a write empties MLX's buffer cache


@dataclass
class Saved:
    """A file just written: its size and the xxh3 sums its final name carries."""

    size: int
    head_sum: str  # of its header: the length and the JSON
    file_sum: str  # of the whole file


def summed(blob: bytes) -> Saved:
    """A safetensors file's `Saved`, from its bytes."""
    offset = 8 + struct.unpack("<Q", blob[:8])[0]
    return Saved(len(blob), _digest(blob[:offset]), _digest(blob))


def save(path: Path, arrays: dict[str, Any], metadata: dict[str, str], writer: Any = None) -> Saved | None:
    """The arrays as a safetensors file: `mx.save_safetensors` where memory is one (a
    Mac) or the CPU's. On CUDA the host must never read an MLX buffer: the first host
    read moves it for good from device memory into managed memory (MLX's CUDA
    allocator), and the GPU's next read pulls it back page by page (~1.3 GB/s on an
    H200 host). So the bytes go through `writer`, the disk tier's page-locked buffer,
    copied there by a kernel (pinned_write.py). Where that path does not work, through copies made
    on the device, which take the move instead of the store's arrays: once read they
    go back, managed memory, to MLX's buffer cache for the next allocation of about
    their size (a block's copies to the next block's, or to a block the store makes,
    which pays the migration back; after copies of `STAGED_CLEAR` bytes or more, which
    would go to the next prefill's KV, MLX's cache is emptied). Where the device has
    no room for the copies, the arrays are written as they are (warned once). Returns
    the file's sums where they were taken as it was written (the pinned path), else
    None: the caller reads it back for them."""
    import mlx.core as mx

    global _copy_failed
    if not on_cuda():
        mx.save_safetensors(str(path), arrays, metadata)
        return None
    done = writer.save(path, arrays, metadata) if writer is not None else None
    if done is not None:
        return done
    try:
        copies = {name: mx.array(a) for name, a in arrays.items()}  # a copy, bit for bit
        mx.eval(list(copies.values()))
    except RuntimeError as exc:  # MLX's "Unable to allocate"
        if not _copy_failed:
            _copy_failed = True
            log.warning("disk cache: no device memory to copy a state before writing it (%s); "
                        "writing the arrays themselves, which moves them to managed memory", exc)
        mx.save_safetensors(str(path), arrays, metadata)
        return None
    staged = sum(a.nbytes for a in copies.values())
    try:
        mx.save_safetensors(str(path), copies, metadata)
    finally:
        del copies
        if staged >= STAGED_CLEAR:
            mx.clear_cache()
    return None


_copy_failed = False
_sum_failed = False


def device_sums(files: list[dict[str, Any]]) -> list[str] | None:
    """devsum's checksum of each of `files`, computed together; None where MLX cannot
    compute them here (warned once): files then go without one, and restores check
    them on the host."""
    global _sum_failed
    from . import devsum

    try:
        return devsum.checksums(files)
    except Exception as exc:  # an integer op this MLX backend lacks, say
        if not _sum_failed:
            _sum_failed = True
            log.warning("disk cache: no device checksum here (%r); restores read each "
                        "file on the host to check it, then load it", exc)
        return None


def _digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def name_digests(name: str, suffix: str = SUFFIX) -> tuple[str, str]:
    """(header checksum, file checksum) from the name of a file written with them, a
    record's or (with its suffix) a block's: `<stem>.<header xxh3>.<file xxh3><suffix>`;
    empty if absent."""
    parts = name.removesuffix(suffix).split(".")
    return (parts[1], parts[2]) if len(parts) == 3 else ("", "")


def _head_bytes(f: Any, size: int) -> tuple[bytes, bytes]:
    """A safetensors file's 8-byte header length and its JSON header, from an open
    file of `size` bytes."""
    first = f.read(8)
    if len(first) < 8:
        raise BadRecord("truncated", "shorter than a header")
    n = struct.unpack("<Q", first)[0]
    if n > min(_MAX_HEADER, size - 8):
        raise BadRecord("corrupt", "header length out of range")
    raw = f.read(n)
    if len(raw) < n:  # shortened since its size was taken
        raise BadRecord("truncated", "shorter than its header length")
    return first, raw


def _data_end(header: dict) -> int:
    """Where a safetensors header says its tensor bytes end (after the header)."""
    return max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
               default=0)


def read_header(path: Path, expect_fingerprint: str) -> Record:
    """The record a file describes, from its header alone."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head, raw = _head_bytes(f, size)
    except OSError as exc:
        raise BadRecord("unreadable", str(exc))
    n = len(raw)
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRecord("corrupt", "header is not JSON")
    if not isinstance(header, dict):
        raise BadRecord("corrupt", "header is not an object")
    try:
        # save_prompt_cache flattens [metadata, classes, scalars]: ours is item 0.
        meta = orjson.loads(header["__metadata__"]["0.kvroute"])
        end = _data_end(header)
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
        raise BadRecord("foreign", "not a kvroute record")
    if 8 + n + end != size:
        raise BadRecord("truncated", f"{size} bytes on disk, the header describes {8 + n + end}")
    if meta.get("version") != FORMAT_VERSION:
        raise BadRecord("version", f"format version {meta.get('version')}, expected {FORMAT_VERSION}")
    header_sum, checksum = name_digests(path.name)
    if _digest(head + raw) != header_sum:
        raise BadRecord("corrupt", "header does not match its checksum")
    if meta.get("fingerprint") != expect_fingerprint:
        raise BadRecord("foreign", "written for other model weights")
    try:
        return Record(
            name=path.name,
            tokens=np.asarray(meta["tokens"], dtype=np.int32),
            scope=meta["scope"],
            chain=[int(k) for k in meta["chain"]],
            trimmable=bool(meta["trimmable"]),
            exit_path=str(meta["exit_path"]),
            size=size,
            data_offset=8 + n,
            checksum=checksum,
            created=float(meta["created"]),
            model=str(meta["model"]),
            blocks=[int(k, 16) for k in meta.get("blocks", [])],
            dsum=str(meta.get("dsum", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise BadRecord("corrupt", "metadata incomplete")


def read_bytes(path: Path, size: int, parallel: int = 4) -> memoryview:
    """The whole file, read in `parallel` slices at once (one large sequential
    read leaves an NVMe drive's queue mostly empty). Into memory nothing fills first:
    a `bytearray` is zeroed while the reader holds the GIL, which serialised a restore's
    block readers (on the 2-core VM, 16 threads read 250 blocks at 2.1 GB/s this way,
    3.4 into unfilled memory, where the kernel's copy touches the pages instead)."""
    view = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        if parallel <= 1 or size < (8 << 20):
            pread_into(fd, view, 0)
        else:
            from concurrent.futures import ThreadPoolExecutor

            step = -(-size // parallel)
            with ThreadPoolExecutor(parallel) as pool:
                list(pool.map(lambda a: pread_into(fd, view[a:a + step], a), range(0, size, step)))
    finally:
        os.close(fd)
    return view


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise BadRecord("truncated", "file ended early")
        done += n


DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
           "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
           "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool_"}


def load(path: Path, record: Record, parallel: int = 4) -> list[Any]:
    """The layer caches a record holds, checked against its checksum before any of
    it is handed out. MLX's own reader is the fast path (one read straight into MLX's
    memory; the checksum then runs over those buffers); where its buffers cannot be
    viewed from Python, the file is read into memory, checked, then copied in. On
    CUDA the file is read and checked first (MLX's buffers live on the device there,
    and checksumming them would copy every byte back), then MLX reads it again
    (`load_checked`)."""
    if on_cuda():
        return load_checked(path, record, parallel)
    try:
        return _load_mlx(path, record)
    except BadRecord:
        raise
    except Exception:
        pass
    return load_copy(path, record, parallel)


def _load_mlx(path: Path, record: Record) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod

    with open(path, "rb") as f:
        head = f.read(record.data_offset)
    header = orjson.loads(head[8:])
    header.pop("__metadata__", None)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    mx.eval(list(arrays.values()))
    digest = xxhash.xxh3_64(head)  # then the tensors in file order: the file's data section
    for name, _ in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a = arrays[name]
        if a.size:
            a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            digest.update(memoryview(np.asarray(a)).cast("B"))
    if digest.hexdigest() != record.checksum:
        raise BadRecord("corrupt", "the file does not match its checksum")
    return _rebuild(cache_mod, arrays, metadata, mx)


def read_into(path: Path, view: memoryview) -> None:
    """A whole file read into `view`, exactly its size as the index knows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise BadRecord("unreadable", str(exc))
    try:
        pread_into(fd, view, 0)
    except OSError as exc:
        raise BadRecord("unreadable", str(exc))
    finally:
        os.close(fd)


def checked_view(view: memoryview, header_sum: str, file_sum: str, what: str) -> tuple[dict, int]:
    """A whole safetensors file's bytes checked against its xxh3 sums (its header's
    and its own, as its name carries them): its tensor table, metadata included, and
    where its tensors start."""
    if len(view) < 8:
        raise BadRecord("truncated", f"{what} is shorter than a header")
    offset = 8 + struct.unpack("<Q", view[:8])[0]
    if offset > len(view) or _digest(view[:offset]) != header_sum or _digest(view) != file_sum:
        raise BadRecord("corrupt", f"{what} does not match its checksums")
    try:
        return orjson.loads(view[8:offset]), offset
    except orjson.JSONDecodeError:
        raise BadRecord("corrupt", f"{what}: its header is not JSON")


def read_checked_into(path: Path, view: memoryview) -> tuple[dict, dict, int]:
    """A record's whole file read into `view` (its size as the index knows it) and
    checked there against the xxh3 sums its name carries: its tensor table, its
    metadata, and where its tensors start. Its name must carry them (`has_sums`)."""
    try:
        on_disk = os.stat(path).st_size
    except OSError as exc:
        raise BadRecord("unreadable", str(exc))
    if on_disk != len(view):
        raise BadRecord("truncated" if on_disk < len(view) else "corrupt",
                        f"{on_disk} bytes on disk, expected {len(view)}")
    read_into(path, view)
    header, offset = checked_view(view, *name_digests(path.name), "the file")
    return header, header.pop("__metadata__", {}), offset


def has_sums(name: str) -> bool:
    """Whether a record's file name carries its xxh3 sums (`read_checked_into`)."""
    return all(name_digests(name))


def from_arrays(arrays: dict[str, Any], metadata: dict) -> list[Any]:
    """A record's layer caches from its tensors, loaded and checked by the caller."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod

    return _rebuild(cache_mod, arrays, metadata, mx)


def on_cuda() -> bool:
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available()


def load_checked(path: Path, record: Record, parallel: int = 4) -> list[Any]:
    """`load` on CUDA. A record with a device checksum is loaded once, by MLX's reader
    (into device memory), and checked there. One without is read and checked on the
    host first, then loaded by MLX's reader (a second read, from the page cache): an
    array made from host bytes lands in managed memory, which the GPU then pulls over
    page by page (measured ~1.3 GB/s on an H200 host), where MLX's reader copies the
    file into device memory in one transfer (3.5 GB/s on one thread). The files are
    never rewritten in place (a new state is a new name), so the bytes checked are
    the bytes loaded."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod

    if record.dsum:
        header, _ = read_head(path, record.size, name_digests(path.name)[0])
        metadata = header.pop("__metadata__", {})
        arrays = load_on_device(path, header, record.dsum, "the file")
        if arrays is not None:
            return _rebuild(cache_mod, arrays, metadata, mx)
    blob = _checked_bytes(path, record, parallel)
    header = orjson.loads(memoryview(blob)[8:record.data_offset])
    metadata = header.pop("__metadata__", {})
    arrays = load_arrays(path, header)
    if arrays is None:
        arrays = arrays_from_bytes(blob, header, record.data_offset)
    return _rebuild(cache_mod, arrays, metadata, mx)


def read_head(path: Path, size: int, header_sum: str) -> tuple[dict, int]:
    """A safetensors file's JSON header (its metadata included) and where its tensors
    start, from the header's bytes alone: checked against `header_sum`, and the file
    against the `size` its header and the index give."""
    try:
        with open(path, "rb") as f:
            on_disk = os.fstat(f.fileno()).st_size
            if on_disk < size:
                raise BadRecord("truncated", f"{on_disk} bytes on disk, expected {size}")
            first, raw = _head_bytes(f, size)
    except OSError as exc:
        raise BadRecord("unreadable", str(exc))
    if on_disk != size or _digest(first + raw) != header_sum:
        raise BadRecord("corrupt", "header or size does not match its checksum")
    n = len(raw)
    try:
        header = orjson.loads(raw)
        end = _data_end(header)
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError):
        raise BadRecord("corrupt", "tensor table")
    if 8 + n + end != size:
        raise BadRecord("truncated", f"{size} bytes, the header describes {8 + n + end}")
    return header, 8 + n


def load_on_device(path: Path, header: dict, dsum: str, what: str) -> dict[str, Any] | None:
    """The tensors `header` lists (no `__metadata__`), loaded once by MLX's reader and
    checked against their device checksum where they landed. None when MLX cannot
    read them or compute the sum here: the caller reads and checks on the host."""
    arrays = load_arrays(path, header)
    sums = None if arrays is None else device_sums([arrays])
    if sums is None:
        return None
    if sums[0] != dsum:
        raise BadRecord("corrupt", f"{what} does not match its device checksum")
    return arrays


_reader_failed = False


def load_arrays(path: Path, header: dict) -> dict[str, Any] | None:
    """The tensors of a safetensors file through MLX's reader (into device memory on
    CUDA), evaluated on this thread; they must be the tensors `header` lists. The
    caller checks their bytes: on the host before, or by device checksum after. None
    when MLX's reader fails (warned once): the caller makes them from the bytes it
    checked instead, so a reader problem never costs the file."""
    import mlx.core as mx

    global _reader_failed
    try:
        arrays = mx.load(str(path))
        mx.eval(list(arrays.values()))
    except Exception as exc:  # MLX raises RuntimeError, ValueError, ... by platform
        if not _reader_failed:
            _reader_failed = True
            log.warning("disk cache: MLX's reader failed on %s (%r); restores make arrays "
                        "from the bytes read instead", path.name, exc)
        return None
    if set(arrays) != set(header) or any(
            list(arrays[n].shape) != list(t["shape"]) for n, t in header.items()):
        raise BadRecord("corrupt", "the file's tensors are not those its header lists")
    return arrays


def load_copy(path: Path, record: Record, parallel: int = 4) -> list[Any]:
    """`load` through a read into memory (`parallel` slices at once) and one copy."""
    return from_bytes(_checked_bytes(path, record, parallel), record.data_offset)


def _checked_bytes(path: Path, record: Record, parallel: int) -> memoryview:
    """The whole file, read `parallel` slices at once, matching its checksum."""
    try:
        blob = read_bytes(path, record.size, parallel)
    except OSError as exc:
        raise BadRecord("unreadable", str(exc))
    if _digest(blob) != record.checksum:
        raise BadRecord("corrupt", "the file does not match its checksum")
    return blob


def from_bytes(blob: memoryview, data_offset: int) -> list[Any]:
    """Arrays straight from the file's bytes: one copy into MLX's memory (through a
    BytesIO, MLX's reader would copy the whole file once more and slowly)."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod

    header = orjson.loads(memoryview(blob)[8:data_offset])
    metadata = header.pop("__metadata__", {})
    return _rebuild(cache_mod, arrays_from_bytes(blob, header, data_offset), metadata, mx)


def arrays_from_bytes(blob: memoryview, header: dict, data_offset: int) -> dict[str, Any]:
    """The tensors of a safetensors file's bytes (its header without `__metadata__`)."""
    import mlx.core as mx

    arrays = {}
    try:
        for name, t in header.items():
            a, b = t["data_offsets"]
            kind = DTYPES[t["dtype"]]
            raw = np.frombuffer(blob, dtype=np.uint16 if kind == "bfloat16" else kind,
                                count=(b - a) // (2 if kind == "bfloat16" else np.dtype(kind).itemsize),
                                offset=data_offset + a)
            arr = mx.array(raw.reshape(t["shape"]))
            arrays[name] = arr.view(mx.bfloat16) if kind == "bfloat16" else arr
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRecord("corrupt", f"tensor table: {exc}")
    # Evaluated here, on the reader thread: MLX's CUDA streams belong to the thread that
    # made them, and the engine thread cannot run a graph recorded on this one's.
    mx.eval(list(arrays.values()))
    return arrays


def _rebuild(cache_mod: Any, arrays: dict, metadata: dict, mx: Any) -> list[Any]:
    # mlx-lm's load_prompt_cache, fed from arrays already in memory.
    from mlx.utils import tree_unflatten

    _, classes, scalars = tree_unflatten(list(metadata.items()))
    for pos, kind in scalars[1:]:
        array = arrays[pos]
        if kind == "scalar":
            arrays[pos] = array.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise BadRecord("corrupt", f"unknown scalar kind {kind}")
    states = tree_unflatten(list(arrays.items()))
    cache = [getattr(cache_mod, c).from_state(s) for c, s in zip(classes, states)]
    mx.eval([c.state for c in cache])
    return cache
