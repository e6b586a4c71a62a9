"""The disk tier's shared blocks: each 32-token block of full-attention KV (paged.py)
in a file of its own under `blocks/`, written once however many records use it.

A record (diskfile.py) lists the chain keys of the blocks that precede its own
tokens; the key names the block's file, `<key>.<header xxh3>.<file xxh3>.kvb.safetensors`,
so a block already on disk is never written again, and a restart that restores
conversations sharing a prefix reads that prefix once (blocks being read or held by
a restored state are shared, `loaded`). The header carries the format version, the
model fingerprint and the key (and, written on CUDA where restores cannot go through
pinned memory, the arrays' device checksum, which a restore there checks where MLX's
reader put them: diskfile.py); the checksums
in the name cover the header and the whole file, as a record's do. A block is written (to a temporary name, fsynced
under the tier's policy, renamed) before the record that lists it, so a crash leaves
at most blocks no record lists; a restart removes those. A block file that is
missing or damaged fails the record that lists it, which is dropped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson


from . import diskfile, pinned, pinned_write
from .diskfile import BadRecord

log = logging.getLogger("kvroute.backend.disk")

FOLDER = "blocks"
SUFFIX = ".kvb.safetensors"
VERSION = 1


@dataclass
class _Unchecked:
    """A block file on CUDA whose arrays are loaded together with the restore's
    others, then compared with their device checksum."""

    key: int
    file: "BlockFile"
    arrays: dict[str, Any]
    dsum: str
    header: dict  # its tensors (checked against the header's checksum)


@dataclass
class BlockFile:
    name: str
    size: int
    refs: int = 0  # records that list it


class Blocks:
    """The block files of one disk tier; the tier's lock guards `files` and refs."""

    def __init__(self, directory: Path, fingerprint: str, fsync: bool, lock: Any = None):
        self.directory = directory / FOLDER
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.files: dict[int, BlockFile] = {}
        self.nbytes = 0
        self.reads = 0  # block files read (a shared prefix restored once counts once)
        self.read_bytes = 0
        # Blocks read back and still held by a restored state: the next restore of a
        # record listing them shares them instead of reading them again.
        self.loaded: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._load_lock = threading.Lock()
        self.lock = lock or threading.RLock()  # the tier's: guards `files` and refs
        # A block the RAM store holds, by key (its pool's dict lookup): the same KV, not
        # read again. Blocks are immutable, so a reader thread may take one.
        self.in_ram: Any = lambda key: None
        self.staging = pinned.Staging()  # CUDA restores' pinned buffer (made when the tier opens)
        self.writer = pinned_write.Writer()  # CUDA writes' pinned buffer (the same)

    def open(self) -> None:
        """Index the folder by its file names (headers are checked when read)."""
        self.directory.mkdir(mode=0o700, exist_ok=True)
        for path in self.directory.iterdir():
            key = _key_of(path.name)
            if key is None:
                _unlink(path)  # a half write (temporary name) or a stray file
                continue
            self.files[key] = BlockFile(path.name, path.stat().st_size)
            self.nbytes += self.files[key].size

    def drop_unlisted(self) -> int:
        """Remove the blocks no record lists (a crash between a block and its record)."""
        orphans = [k for k, f in self.files.items() if f.refs == 0]
        for key in orphans:
            self._delete(key)
        return len(orphans)

    def hold(self, keys: list[int]) -> bool:
        """Count a record's use of its blocks; False (nothing counted) when one is missing."""
        if any(k not in self.files for k in keys):
            return False
        for k in keys:
            self.files[k].refs += 1
        return True

    def release(self, keys: list[int]) -> None:
        for k in keys:
            f = self.files.get(k)
            if f is not None:
                f.refs -= 1
                if f.refs <= 0:
                    self._delete(k)

    def _delete(self, key: int) -> None:
        f = self.files.pop(key)
        self.nbytes -= f.size
        _unlink(self.directory / f.name)

    def missing(self, keys: list[int]) -> list[int]:
        return [k for k in keys if k not in self.files]

    def write(self, blocks: list[Any], between: Callable[[], None] | None = None) -> int:
        """Write blocks (writer thread; their arrays are evaluated): each to a temporary
        name, all fsynced at once (one drive flush's wait, not one each), then renamed
        into place and the folder fsynced. `between()` runs before each file (the tier
        waits there while the engine has work). Returns the bytes written."""
        tmps: list[Path] = []
        saved: list[diskfile.Saved | None] = []  # each file's sums, where its save took them
        files = [block_arrays(block) for block in blocks]
        sums: list[str | None] = []
        try:
            for i, (block, arrays) in enumerate(zip(blocks, files)):
                if between is not None:
                    between()
                if i == len(sums):  # the next blocks' device checksums, together
                    group = files[i:i + _per_pass(arrays)]
                    # Restores through pinned memory check the xxh3 instead: the GPU's
                    # time goes to the engine. Only MLX's reader needs the device sum.
                    sums += [None] * len(group) if self.staging.works() else diskfile.sums_to_write(group)
                stem = f"{block.key:016x}"
                tmp = self.directory / (stem + diskfile.TMP_SUFFIX)
                tmps.append(tmp)
                meta = {"version": VERSION, "fingerprint": self.fingerprint, "key": stem}
                if sums[i]:  # a restore on CUDA checks the arrays where MLX loads them
                    meta["dsum"] = sums[i]
                saved.append(diskfile.save(tmp, arrays, {"kvroute_block": orjson.dumps(meta).decode()},
                                           self.writer))
            if self.fsync:
                fsync_files(tmps)
            written = 0
            for block, tmp, done in zip(blocks, tmps, saved):
                if done is None:  # just written: its sums from the page cache
                    done = diskfile.summed(tmp.read_bytes())
                name = f"{block.key:016x}.{done.head_sum}.{done.file_sum}{SUFFIX}"
                os.replace(tmp, self.directory / name)
                with self.lock:
                    self.files[block.key] = BlockFile(name, done.size)
                    self.nbytes += done.size
                written += done.size
        except BaseException:
            for tmp in tmps:
                _unlink(tmp)
            raise
        if self.fsync:
            diskfile._fsync_dir(self.directory)
        return written

    def load(self, key: int, make: Any) -> Any:
        """A block's arrays as `make(key, kv, nbytes)` builds them, shared with any state
        still holding them, its file read and checked on the host (reader threads)."""
        block = self._held(key)
        if block is not None:
            return block
        f = self._file(key)
        with self._forgetting(key, f):
            kv, size = self._read(key, self.directory / f.name, f.size)
        return self._register(key, kv, size, make)

    def load_all(self, keys: list[int], make: Any, readers: ThreadPoolExecutor) -> list[Any]:
        """The blocks of `keys`, in order, as `load` makes them, read on `readers`. On
        CUDA the files go onto the device through pinned host memory (pinned.py),
        checked there on the host as they land; those it cannot take, and all where it
        fails, as `_on_device` loads them."""
        if not diskfile.on_cuda():
            return list(readers.map(lambda k: self.load(k, make), keys))
        got = [self._held(k) for k in keys]
        if not self.staging.failed:
            todo = [i for i, g in enumerate(got) if g is None]
            for i, block in zip(todo, self._pinned([keys[i] for i in todo], make, readers)):
                got[i] = block
        rest = [i for i, g in enumerate(got) if g is None]
        for i, block in zip(rest, self._on_device([keys[i] for i in rest], make, readers)):
            got[i] = block
        return got

    def _pinned(self, keys: list[int], make: Any, readers: ThreadPoolExecutor) -> list[Any]:
        """The blocks of `keys` through pinned memory, each file read once and checked
        against its name's xxh3 where the kernel copies it from; None for a file the
        path cannot take, or for all where it fails here."""
        files = [pinned.File(self.directory / f.name, f.size, (k, f))
                 for k, f in ((k, self._file(k)) for k in keys)]
        loaded = self.staging.load_or_none(files, readers, self._fill)
        if loaded is None:
            return [None] * len(keys)
        t = time.perf_counter()
        blocks = [None if arrays is None else self._register(f.owner[0], _pairs(arrays), f.size, make)
                  for f, arrays in zip(files, loaded)]
        self.staging.add("blocks made", time.perf_counter() - t)
        return blocks

    def _fill(self, f: pinned.File, view: memoryview) -> tuple[dict, int]:
        """A block file read into `view` (pinned memory) and checked (reader thread)."""
        key, file = f.owner
        with self._forgetting(key, file):
            diskfile.read_into(f.path, view)
            return self._checked(key, view, file.name)

    def _on_device(self, keys: list[int], make: Any, readers: ThreadPoolExecutor) -> list[Any]:
        """The blocks of `keys` on CUDA without pinned memory: the files carrying a
        device checksum loaded by MLX's reader and then checked all together
        (devsum.checksums: a pass per ~32 MB of blocks, where one file at a time cost a
        dozen MLX operations and a wait for the device each); the others read and
        checked on the host. A block that fails its sum is deleted (every one that
        does) and fails the restore; where the sums cannot be computed, each file is
        checked on the host."""
        got = list(readers.map(lambda k: self._unchecked(k, make), keys))
        waiting = [g for g in got if isinstance(g, _Unchecked)]
        for w, arrays in zip(waiting, readers.map(self._mlx_load, waiting)):
            w.arrays = arrays
        # Where MLX's reader failed (warned once): read and checked on the host instead.
        hosted = {w.key: self.load(w.key, make) for w in waiting if not w.arrays}
        waiting = [w for w in waiting if w.arrays]
        sums = diskfile.device_sums([w.arrays for w in waiting]) if waiting else []
        if sums is None:  # no device sum here after all: each file checked on the host
            for w in waiting:
                w.arrays = {}  # let go before the second read
            return list(readers.map(lambda g: self.load(g.key, make) if isinstance(g, _Unchecked) else g, got))
        bad = [w for w, dsum in zip(waiting, sums) if dsum != w.dsum]
        if bad:
            for w in bad:
                self._forget(w.key, w.file)
            raise BadRecord("corrupt", f"block {bad[0].key:016x} does not match its device checksum")
        done = hosted | {w.key: self._register(w.key, _pairs(w.arrays), w.file.size, make) for w in waiting}
        return [done[g.key] if isinstance(g, _Unchecked) else g for g in got]

    def _unchecked(self, key: int, make: Any) -> Any:
        """A block held already, or its file's header read and checked (`_Unchecked`,
        its arrays still to load), or, for a file without a device checksum, the file
        read and checked on the host (reader thread)."""
        block = self._held(key)
        if block is not None:
            return block
        f = self._file(key)
        path = self.directory / f.name
        with self._forgetting(key, f):
            header, _ = diskfile.read_head(path, f.size, diskfile.name_digests(f.name, SUFFIX)[0])
            dsum = self._meta(key, header).get("dsum")
            if not dsum:
                return self._register(key, *self._read(key, path, f.size), make)
        return _Unchecked(key, f, {}, dsum, header)

    def _mlx_load(self, w: _Unchecked) -> dict[str, Any]:
        with self._forgetting(w.key, w.file):
            return diskfile.load_arrays(self.directory / w.file.name, w.header) or {}

    def restored(self, key: int) -> Any:
        """A block read back and still held by a restored state (any thread)."""
        with self._load_lock:
            return self.loaded.get(key)

    def _held(self, key: int) -> Any:
        with self._load_lock:
            block = self.loaded.get(key)
        return block if block is not None else self.in_ram(key)

    def _file(self, key: int) -> BlockFile:
        f = self.files.get(key)
        if f is None:
            raise BadRecord("corrupt", f"block {key:016x} is missing")
        return f

    @contextmanager
    def _forgetting(self, key: int, f: BlockFile):
        """A block file found bad is never read again: records listing it fail when read."""
        try:
            yield
        except BadRecord:
            self._forget(key, f)
            raise

    def _forget(self, key: int, f: BlockFile) -> None:
        with self.lock:
            if self.files.get(key) is f:  # not a newer file of the same block
                self._delete(key)

    def _register(self, key: int, kv: list, size: int, make: Any) -> Any:
        with self._load_lock:
            block = self.loaded.get(key)
            if block is None:
                block = make(key, kv, size)
                self.loaded[key] = block
                self.reads += 1
                self.read_bytes += size
        return block

    def _read(self, key: int, path: Path, size: int) -> tuple[list[tuple[Any, Any]], int]:
        try:
            # Straight into the buffer the arrays are read from: `read_bytes()` then a
            # bytearray copy made a restore copy every block twice before MLX's own. The
            # size is the index's (a shorter file is truncated, a longer one fails its sum).
            blob = diskfile.read_bytes(path, size, parallel=1)
        except OSError as exc:
            raise BadRecord("unreadable", str(exc))
        header, offset = self._checked(key, memoryview(blob), path.name)
        # On CUDA without a device checksum (an older file): checked here, then into
        # device memory through MLX's reader (diskfile.load_checked).
        arrays = diskfile.load_arrays(path, header) if diskfile.on_cuda() else None
        if arrays is None:
            arrays = diskfile.arrays_from_bytes(blob, header, offset)
        return _pairs(arrays), len(blob)

    def _checked(self, key: int, view: memoryview, name: str) -> tuple[dict, int]:
        """A whole block file's bytes checked against the xxh3 sums its name carries:
        its tensor table (its metadata checked and taken out) and where tensors start."""
        header, offset = diskfile.checked_view(view, *diskfile.name_digests(name, SUFFIX),
                                               f"block {key:016x}")
        self._meta(key, header)
        return header, offset

    def _meta(self, key: int, header: dict) -> dict:
        """A block header's kvroute metadata, popped from `header`; it must be ours."""
        try:
            meta = orjson.loads(header.pop("__metadata__")["kvroute_block"])
        except (KeyError, TypeError, ValueError):
            raise BadRecord("foreign", "not a kvroute block")
        if not isinstance(meta, dict) or meta.get("fingerprint") != self.fingerprint \
                or meta.get("key") != f"{key:016x}":
            raise BadRecord("foreign", f"block {key:016x} written for other weights or key")
        return meta

    def stats(self) -> dict:
        return {"blocks": len(self.files), "block_bytes": self.nbytes, "block_reads": self.reads}


def _per_pass(arrays: dict[str, Any]) -> int:
    """Block files like this one that one device-checksum pass takes."""
    from .devsum import GROUP_BYTES

    return max(1, GROUP_BYTES // max(1, sum(a.nbytes for a in arrays.values())))


def block_arrays(block: Any) -> dict[str, Any]:
    """A block's arrays as its file names them (`_pairs` reads them back)."""
    return {f"{kind}{i}": a for i, pair in enumerate(block.kv) for kind, a in zip("kv", pair)}


def _pairs(arrays: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(arrays[f"k{i}"], arrays[f"v{i}"]) for i in range(len(arrays) // 2)]


def fsync_files(paths: list[Path]) -> None:
    """fsync files 8 at once: one drive flush's wait, not one each."""
    with ThreadPoolExecutor(min(8, len(paths))) as pool:
        list(pool.map(_fsync_file, paths))


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _key_of(name: str) -> int | None:
    if not name.endswith(SUFFIX):
        return None
    parts = name.removesuffix(SUFFIX).split(".")
    try:
        return int(parts[0], 16) if len(parts) == 3 else None
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a read-only folder: the file stays, unlisted
        log.debug("disk cache: cannot remove %s (%s)", path.name, exc)
