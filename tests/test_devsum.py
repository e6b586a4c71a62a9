"""The device checksum a CUDA restore checks disk-tier files with (devsum.py).

Its value must be the same wherever MLX computes it (the writer and the reader may
run on different devices and reduce in different orders), so it is held here to a
reference written separately in numpy; and it must change for the damage a disk
does. The GPU itself cannot run here: MLX's CPU backend computes it."""

import threading

import mlx.core as mx
import numpy as np
import orjson
import pytest
import xxhash

from kvroute.backend import devsum


def np_splitmix64(x: np.ndarray) -> np.ndarray:
    x = x * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def np_lanes(words: np.ndarray) -> list[list[int]]:
    rows = []
    for start in range(0, words.size, devsum.CHUNK):
        chunk = words[start:start + devsum.CHUNK]
        pos = np.arange(chunk.size, dtype=np.uint32)
        with np.errstate(over="ignore"):
            first = (chunk * ((pos * np.uint32(2) + np.uint32(1)) * np.uint32(0x9E3779B1))).sum(dtype=np.uint32)
            weights = np_splitmix64(pos.astype(np.uint64)) | np.uint64(1)
            second = (chunk.astype(np.uint64) * weights).sum(dtype=np.uint64)
        rows.append([int(first), int(second)])
    return rows


def lanes(words) -> list[list[int]]:
    """devsum's lanes of one run of uint32 words."""
    return devsum._file_lanes([{"w": mx.array(np.asarray(words, dtype=np.uint32))}], ["w"])[0].tolist()


@pytest.mark.parametrize("n", [1, 7, 4096, devsum.CHUNK, 3 * devsum.CHUNK + 5])
def test_lanes_are_the_reference_integer_sums(n):
    words = np.random.default_rng(n).integers(0, 1 << 32, n, dtype=np.uint32)
    assert lanes(words) == np_lanes(words)


def test_the_sum_is_the_reference_digest():
    """The value a file written by any kvroute carries: xxh3 of the arrays' names,
    dtypes and shapes, then of every chunk's lanes over their words in name order."""
    arrays = {"v0": bf16((3, 2, 32, 16), 5), "k0": bf16((2, 5, 7), 6), "n": mx.array([])}
    words = np.concatenate([np.array(arrays[n].reshape(-1).view(mx.uint32)) for n in ("k0", "v0")])
    h = xxhash.xxh3_64(orjson.dumps([[n, str(arrays[n].dtype), list(arrays[n].shape)]
                                     for n in sorted(arrays)]))
    h.update(np.array(np_lanes(words), dtype=np.uint64).tobytes())
    assert devsum.checksum(arrays) == h.hexdigest()


def test_files_summed_together_sum_as_each_alone(monkeypatch):
    """A restore sums its block files together: each file's sum is the one it has
    alone, whatever files share its pass (alike or not, a whole number of chunks or
    not, empty arrays, a pass cut by the group size), and damage to one changes its
    sum only."""
    blocks = [{"k0": bf16((2, 4, 32, 64), i), "v0": bf16((2, 4, 32, 64), 50 + i)} for i in range(5)]
    odd = [{"k0": bf16((3, 5, 7), 9), "v0": bf16((3, 5, 7), 10)} for _ in range(2)]
    files = blocks[:2] + odd[:1] + blocks[2:] + [{"e": mx.array([])}, {"k0": bf16((2, 3)), "e": mx.array([])}] + odd[1:]
    alone = [devsum.checksum(f) for f in files]
    assert len(set(alone)) == len(files) - 1  # the two `odd` files hold the same words
    monkeypatch.setattr(devsum, "GROUP_BYTES", 2 * sum(a.nbytes for a in blocks[0].values()))
    assert devsum.checksums(files) == alone
    assert devsum.checksums(files[::-1]) == alone[::-1]
    hurt = damaged(blocks[3], "v0", lambda w: w.__setitem__(100, w[100] ^ 1))
    again = devsum.checksums(files[:4] + [hurt] + files[5:])
    assert [a != b for a, b in zip(again, alone)] == [i == 4 for i in range(len(files))]


def bf16(shape, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.bfloat16)


def test_the_words_are_the_bytes_as_saved(tmp_path):
    """Every dtype a cache saves, odd sizes and strided views included: the words are
    the file's bytes (read back here with numpy), widened where a size is not whole
    words."""
    arrays = {"a": bf16((2, 3, 5, 8)), "b": mx.arange(7, dtype=mx.uint8), "c": mx.array(3),
              "d": bf16((3, 5)), "e": mx.arange(24, dtype=mx.float32).reshape(4, 6)[:, ::2],
              "f": mx.array([True, False, True])}
    mx.save_safetensors(str(tmp_path / "x.safetensors"), arrays)
    for name, a in arrays.items():
        raw = np.array(a.reshape(-1).view(mx.uint8) if a.dtype != mx.bool_ else a.astype(mx.uint8)).tobytes()
        width = np.uint32 if len(raw) % 4 == 0 else np.uint16 if len(raw) % 2 == 0 else np.uint8
        assert np.array(devsum._words(a[None])[0]).tolist() == np.frombuffer(raw, width).astype(np.uint32).tolist(), name
    loaded = mx.load(str(tmp_path / "x.safetensors"))
    assert devsum.checksum(loaded) == devsum.checksum(arrays)


def damaged(arrays: dict, name: str, change) -> dict:
    a = arrays[name]
    words = np.array(a.reshape(-1).view(mx.uint16)).copy()
    change(words)
    return {**arrays, name: mx.array(words).view(a.dtype).reshape(a.shape)}


def test_damage_changes_the_sum():
    arrays = {"k0": bf16((4, 2, 32, 16), 1), "v0": bf16((4, 2, 32, 16), 2)}
    base = devsum.checksum(arrays)
    rng = np.random.default_rng(0)
    for _ in range(20):  # any one bit, anywhere
        i, bit = int(rng.integers(4096)), int(rng.integers(16))
        assert devsum.checksum(damaged(arrays, "v0", lambda w: w.__setitem__(i, w[i] ^ (1 << bit)))) != base

    def two_top_bits(w):  # the top bit of two 32-bit words: cancels in the first lane
        w[1] ^= 0x8000
        w[9] ^= 0x8000

    def swap(w):
        w[[10, 11]] = w[[11, 10]]

    def zero_page(w):
        w[2048:4096] = 0

    for change in (two_top_bits, swap, zero_page):
        assert devsum.checksum(damaged(arrays, "k0", change)) != base, change.__name__
    # The pair of top-bit flips is the second lane's to find: the first cannot.
    words = devsum._words(arrays["k0"][None])[0]
    [(first, second)] = lanes(np.array(words))
    flipped = devsum._words(damaged(arrays, "k0", two_top_bits)["k0"][None])[0]
    [again] = lanes(np.array(flipped))
    assert again[0] == first and again[1] != second
    assert devsum.checksum({"k0": arrays["v0"], "v0": arrays["k0"]}) != base  # files swapped
    assert devsum.checksum({"k1": arrays["k0"], "v0": arrays["v0"]}) != base  # renamed
    reshaped = {"k0": arrays["k0"].reshape(2, 4, 32, 16), "v0": arrays["v0"]}
    assert devsum.checksum(reshaped) != base  # same bytes, another shape


def test_the_same_on_a_reader_thread():
    arrays = {"k0": bf16((4, 2, 32, 16), 3), "v0": bf16((4, 2, 32, 16), 4)}
    here = devsum.checksum(arrays)
    devsum._weights.clear()  # made by the threads themselves
    got = []
    threads = [threading.Thread(target=lambda: got.append(devsum.checksum(arrays))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [here] * 4
