from lmcache_mp.client import chunk_hashes
from lmcache_mp.client.hashing import HASH_SEED


def test_one_hash_per_full_chunk():
    assert chunk_hashes(list(range(255)), 256) == []
    assert len(chunk_hashes(list(range(256 * 3 + 100)), 256)) == 3
    assert all(len(h) == 16 for h in chunk_hashes(list(range(512)), 256))


def test_hashes_name_whole_prefixes():
    tokens = list(range(1024))
    full = chunk_hashes(tokens, 256)
    assert chunk_hashes(tokens[:512], 256) == full[:2]
    changed = tokens.copy()
    changed[10] = 99999  # inside the first chunk: every later hash changes too
    assert all(a != b for a, b in zip(chunk_hashes(changed, 256), full))
    changed = tokens.copy()
    changed[600] = 99999  # inside the third chunk: the first two stay
    assert chunk_hashes(changed, 256)[:2] == full[:2] and chunk_hashes(changed, 256)[2] != full[2]


def test_same_chunk_after_different_prefixes_differs():
    a = chunk_hashes([1] * 256 + [7] * 256, 256)
    b = chunk_hashes([2] * 256 + [7] * 256, 256)
    assert a[1] != b[1]


def test_stable_across_processes_and_machines():
    # Keys must agree between every engine instance everywhere: pin the algorithm's output.
    assert HASH_SEED.hex() == "2a032d847c66fb9758cee15a5d3ff6f3"
    assert [h.hex() for h in chunk_hashes(list(range(512)), 256)] == [
        "d4c936884ef0f9f19b928792eed2087c", "21c1023e7fca972372b9772d0481879c"]


def test_extra_keys_change_their_chunk_and_every_later_one_only():
    tokens = list(range(768))
    plain = chunk_hashes(tokens, 256)
    assert chunk_hashes(tokens, 256, [b"", b"", b""]) == plain  # nothing extra: the same keys
    assert chunk_hashes(tokens, 256, [b""]) == plain  # fewer keys than chunks: the rest plain
    image_a = chunk_hashes(tokens, 256, [b"", b"image-a"])
    image_b = chunk_hashes(tokens, 256, [b"", b"image-b"])
    assert image_a[0] == image_b[0] == plain[0]  # the chunk before the image is shared
    assert len({image_a[1], image_b[1], plain[1]}) == 3
    assert len({image_a[2], image_b[2], plain[2]}) == 3  # chained: later chunks differ too
    assert chunk_hashes(tokens, 256, [b"", b"image-a"]) == image_a
