"""The disk tier's faults, end to end: a folder that turns read-only, a damaged file
that cannot be removed, a damaged header, a crash at every step of a write. None of
them may become a 500, a failed start or a wrong answer.

Real backend processes on real files; the tests run as root, which ignores permission
bits, so an undeletable file is `chattr +i` and a read-only folder a tmpfs remounted
read-only (what ext4 does after I/O errors).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest
import xxhash
from tests.harness import BackendProcess, chat, post_json, small_tmpfs, wait_until
from tests.test_disk_tier import GREEDY, kill, metric, next_turn, start, written
from tests.test_families import assert_same_answer, cached, conversation

from kvroute.backend import diskfile

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and chattr need root")


def records(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + diskfile.SUFFIX))


def flip_tensor_byte(path: Path) -> None:
    with open(path, "r+b") as f:  # in place: the file keeps its name and size
        f.seek(-50, os.SEEK_END)
        byte = f.read(1)
        f.seek(-50, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def remount_ro(mount: Path) -> None:
    if subprocess.run(["mount", "-o", "remount,ro", str(mount)]).returncode:
        pytest.skip("cannot remount the tmpfs read-only here")


def immutable(path: Path, on: bool) -> bool:
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)],
                          capture_output=True).returncode == 0


def cold(backend: BackendProcess, messages: list[dict]) -> dict:
    """The same request in a scope nothing is cached for: a cold prefill."""
    answer = chat(backend, messages, scope=uuid.uuid4().hex, **GREEDY).body
    assert cached(answer) == 0
    return answer


@needs_root
def test_read_only_folder_with_a_damaged_file_is_no_500(text_model, tmp_path):
    """A damaged file found while serving, in a folder that takes no more changes: the
    folder and its files `chattr +i` (a tmpfs will not remount read-only while the
    backend holds its lock file open for writing; ext4's remount after I/O errors
    does, and unlink then fails the same way)."""
    disk = tmp_path / "disk"
    backend = start(text_model, "demo", disk, tmp_path, "--cache-bytes", "400KiB")
    frozen = []
    try:
        chats = [conversation(f"Question {i}: which ticket blocks release {i}?") for i in range(2)]
        firsts = [chat(backend, m, **GREEDY).body for m in chats]
        wait_until(lambda: written(backend, 2), 60, what="both conversations on disk")
        for path in [*records(disk), disk]:
            if path != disk:
                flip_tensor_byte(path)
            if not immutable(path, True):
                pytest.skip("chattr +i is not supported on this filesystem")
            frozen.append(path)
        follow = next_turn(chats[0], firsts[0])  # RAM holds only the other conversation
        for _ in range(2):
            status, body = post_json(backend.url + "/v1/chat/completions",
                                     {"model": "demo", "messages": follow, **GREEDY})
            assert status == 200, body
        assert metric(backend, "kvroute_backend_disk_dropped_files_total", reason="corrupt") == 1
        assert metric(backend, "kvroute_backend_cache_hits_total", tier="disk") == 0
        assert_same_answer(body, cold(backend, follow))
        disk_stats = backend.health()["disk"]
        assert (disk_stats["writable"], disk_stats["skipped_files"]) == (False, 1)
        assert backend.log().count("is not writable (EPERM") == 1
        assert metric(backend, "kvroute_backend_disk_write_failures_total", reason="EPERM") >= 1
        assert len(records(disk)) == 2  # the damaged file stays, and is never read again
        assert backend.health()["status"] == "ok"
    finally:
        for path in frozen:
            immutable(path, False)
        backend.stop()


@needs_root
def test_restart_with_a_damaged_file_that_cannot_be_deleted(text_model, tmp_path):
    disk = tmp_path / "disk"
    first = start(text_model, "demo", disk, tmp_path)
    messages = conversation()
    turn1 = chat(first, messages, **GREEDY).body
    wait_until(lambda: written(first), 60, what="turn 1 on disk")
    kill(first)
    stuck = records(disk)
    for path in stuck:
        path.write_bytes(path.read_bytes()[:-100])  # truncated
        if not immutable(path, True):
            pytest.skip("chattr +i is not supported on this filesystem")
    again = None
    try:
        again = start(text_model, "demo", disk, tmp_path, port=first.port)  # starts at all
        assert again.health()["disk"]["skipped_files"] == len(stuck)
        assert again.health()["disk"]["entries"] == 0
        follow = next_turn(messages, turn1)
        answer = chat(again, follow, **GREEDY).body
        assert cached(answer) == 0
        assert_same_answer(answer, cold(again, follow))
        # The folder itself is writable: the tier keeps writing.
        wait_until(lambda: again.health()["disk"]["entries"] >= 1, 60, what="a new write")
        assert again.health()["disk"]["writable"] is True
    finally:
        for path in stuck:
            immutable(path, False)
        if again is not None:
            again.stop()


@needs_root
def test_read_only_folder_at_start_serves_its_whole_files(text_model, tmp_path):
    with small_tmpfs(tmp_path / "small", "16m") as mount:
        backend = None
        try:
            first = start(text_model, "demo", mount / "cache", tmp_path)
            # The start-up line says the budget, the folder and the free space, and
            # warns that this default budget is more than the drive can give.
            assert f"disk tier: 32.0 GiB on {mount / 'cache'} (free 16.0 MiB" in first.log()
            assert "is more than" in first.log() and "lower --disk-cache-bytes" in first.log()
            messages = conversation()
            turn1 = chat(first, messages, **GREEDY).body
            wait_until(lambda: written(first), 60, what="turn 1 on disk")
            kill(first)
            (mount / "cache" / ("x" + diskfile.TMP_SUFFIX)).write_bytes(b"half")  # a damaged file
            remount_ro(mount)
            backend = start(text_model, "demo", mount / "cache", tmp_path, port=first.port)
            disk = backend.health()["disk"]
            assert (disk["enabled"], disk["writable"], disk["skipped_files"]) == (True, False, 1)
            follow = next_turn(messages, turn1)
            hit = chat(backend, follow, **GREEDY).body
            assert cached(hit) >= 0.9 * turn1["usage"]["prompt_tokens"]  # read from disk
            assert_same_answer(hit, cold(backend, follow))
        finally:
            if backend is not None:
                backend.stop()


def _rewrite_tokens(path: Path, tokens: list[int]) -> None:
    """The record's header metadata with other token ids; tensors and name untouched."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = orjson.loads(blob[8:8 + n])
    meta = orjson.loads(header["__metadata__"]["0.kvroute"])
    meta["tokens"] = tokens
    header["__metadata__"]["0.kvroute"] = orjson.dumps(meta).decode()
    raw = orjson.dumps(header)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n:])


def _header(path: Path) -> dict:
    blob = path.read_bytes()
    header = orjson.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    return orjson.loads(header["__metadata__"]["0.kvroute"])


def test_a_flipped_token_id_in_a_header_is_never_used(text_model, tmp_path):
    disk = tmp_path / "disk"
    first = start(text_model, "demo", disk, tmp_path)
    honest = conversation("Ticket 7 blocks the Thursday release; who owns it?")
    altered = [honest[0], {"role": "user", "content": "Ticket 8 blocks the Thursday release; who owns it?"}]
    prompt = chat(first, honest, **GREEDY).body["usage"]["prompt_tokens"]
    chat(first, altered, scope="probe", **GREEDY)  # its file tells the backend's own token ids
    # Both on disk, and the prompts' own records replaced by their finished turns.
    wait_until(lambda: written(first, 2) and len(records(disk)) == 2, 60, what="both on disk")
    kill(first)
    metas = {path: _header(path) for path in records(disk)}
    (probe,) = [m["tokens"] for m in metas.values() if m["scope"] == "probe"]
    for path, meta in metas.items():
        if meta["scope"] == "probe":
            path.unlink()
            continue
        tokens = meta["tokens"]
        diff = [i for i, (a, b) in enumerate(zip(tokens[:prompt], probe)) if a != b]
        assert len(diff) == 1  # the two prompts differ in one token id
        tokens[diff[0]] = probe[diff[0]]
        _rewrite_tokens(path, tokens)

    again = start(text_model, "demo", disk, tmp_path, port=first.port)
    try:
        answer = chat(again, altered, **GREEDY).body
        assert cached(answer) == 0  # nothing of the damaged record
        assert metric(again, "kvroute_backend_cache_hits_total", tier="disk") == 0
        assert metric(again, "kvroute_backend_disk_dropped_files_total", reason="corrupt") >= 1
        assert_same_answer(answer, cold(again, altered))
    finally:
        again.stop()


def test_an_old_format_record_is_dropped_as_stale(text_model, tmp_path):
    disk = tmp_path / "disk"
    first = start(text_model, "demo", disk, tmp_path)
    messages = conversation()
    chat(first, messages, **GREEDY).body
    wait_until(lambda: written(first), 60, what="on disk")
    kill(first)
    for path in records(disk):  # as format 1 wrote it: the tensor checksum alone
        blob = path.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        header = orjson.loads(blob[8:8 + n])
        meta = orjson.loads(header["__metadata__"]["0.kvroute"])
        header["__metadata__"]["0.kvroute"] = orjson.dumps({**meta, "version": 1}).decode()
        raw = orjson.dumps(header)
        stem = path.name.split(".")[0]
        path.unlink()
        (disk / f"{stem}.{xxhash.xxh3_64(blob[8 + n:]).hexdigest()}{diskfile.SUFFIX}").write_bytes(
            len(raw).to_bytes(8, "little") + raw + blob[8 + n:])
    again = start(text_model, "demo", disk, tmp_path, port=first.port)
    try:
        assert again.health()["disk"]["entries"] == 0
        assert metric(again, "kvroute_backend_disk_dropped_files_total", reason="version") >= 1
        assert not records(disk)
        assert cached(chat(again, messages, **GREEDY).body) == 0
    finally:
        again.stop()


CRASH_HOOK = """\
import os, signal
from kvroute.backend import diskfile

def _crash(step):
    if step == {step!r}:
        os.kill(os.getpid(), signal.SIGKILL)

diskfile.crash_point = _crash
"""


@pytest.mark.parametrize("step", ["tmp_written", "tmp_synced", "renamed", "dir_synced"])
def test_a_crash_at_every_step_of_a_write(text_model, tmp_path, step):
    """SIGKILL the backend at one step of its first disk write ("dir_synced": the file
    is whole and in place, the index has not seen it yet); the restarted backend uses
    nothing damaged or half, and serves the conversation."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_HOOK.format(step=step))
    disk = tmp_path / "disk"
    doomed = BackendProcess(text_model, model_id="demo", log_dir=tmp_path, backend_id="doomed",
                            extra=["--prefill-step", "64", "--disk-cache-dir", str(disk)],
                            env={"PYTHONPATH": os.pathsep.join([str(hook), *sys.path])})
    doomed.start()
    messages = conversation()
    try:
        turn1 = chat(doomed, messages, **GREEDY).body
    except Exception:  # the write may kill it before the answer is sent
        turn1 = None
    wait_until(lambda: doomed.proc.poll() is not None, 60, what="the crash")
    assert doomed.proc.returncode == -9
    whole = step in ("renamed", "dir_synced")
    assert len(records(disk)) == (1 if whole else 0)

    again = start(text_model, "demo", disk, tmp_path, port=doomed.port)
    try:
        assert again.health()["disk"]["entries"] == (1 if whole else 0)
        assert not list(disk.glob("*" + diskfile.TMP_SUFFIX))  # a half write is dropped
        if not whole:
            assert metric(again, "kvroute_backend_disk_dropped_files_total", reason="partial") == 1
        turn1 = turn1 or chat(again, messages, **GREEDY).body
        follow = next_turn(messages, turn1)
        answer = chat(again, follow, **GREEDY).body
        if whole:
            assert cached(answer) > 0
            assert metric(again, "kvroute_backend_cache_hits_total", tier="disk") == 1
        assert_same_answer(answer, cold(again, follow))
    finally:
        again.stop()


STEP_LOG = """\
from kvroute.backend import diskfile

def _note(step):
    with open({path!r}, "a") as f:
        f.write(step + "\\n")

diskfile.crash_point = _note
"""


@pytest.mark.parametrize("policy", ["always", "never"])
def test_the_fsync_policy_reaches_the_writer(text_model, tmp_path, policy):
    """KVROUTE_DISK_FSYNC=always fsyncs each record's file, then its folder; `never`
    fsyncs neither (the hook runs right after each real fsync). Both write whole
    records that a restart after SIGKILL serves: the kernel keeps what the process
    wrote, only a power loss can take what was never fsynced."""
    steps = tmp_path / "steps.txt"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STEP_LOG.format(path=str(steps)))
    disk = tmp_path / "disk"
    backend = BackendProcess(text_model, model_id="demo", log_dir=tmp_path, backend_id="fsync",
                             extra=["--prefill-step", "64", "--disk-cache-dir", str(disk)],
                             env={"PYTHONPATH": os.pathsep.join([str(hook), *sys.path]),
                                  "KVROUTE_DISK_FSYNC": policy})
    backend.start()
    messages = conversation()
    try:
        first = chat(backend, messages, **GREEDY).body
        wait_until(lambda: written(backend), 30, what="the record on disk")
    finally:
        kill(backend)
    noted = steps.read_text().split()
    writes = noted.count("renamed")
    assert writes >= 1 and noted.count("tmp_written") == writes
    fsyncs = writes if policy == "always" else 0
    assert (noted.count("tmp_synced"), noted.count("dir_synced")) == (fsyncs, fsyncs), noted

    again = start(text_model, "demo", disk, tmp_path, port=backend.port)
    try:
        assert cached(chat(again, next_turn(messages, first), **GREEDY).body) > 0
        assert metric(again, "kvroute_backend_cache_hits_total", tier="disk") == 1
    finally:
        again.stop()
