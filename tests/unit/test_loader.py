"""The GGUF cache key follows the file's content, so every checkout shares one conversion."""

from __future__ import annotations

import os
import shutil

from shared.engine.loader import FINGERPRINT_SPAN, gguf_fingerprint


def write_file(path, size: int, seed: int = 0):
    path.write_bytes(bytes((i * 31 + seed) % 251 for i in range(size)))
    return path


def test_same_content_at_another_path_and_time_shares_the_key(tmp_path):
    original = write_file(tmp_path / "model.gguf", 3 * FINGERPRINT_SPAN)
    copy_dir = tmp_path / "other-venv"
    copy_dir.mkdir()
    copy = copy_dir / "model.gguf"
    shutil.copyfile(original, copy)
    os.utime(copy, (0, 0))
    assert gguf_fingerprint(original) == gguf_fingerprint(copy)


def test_a_changed_header_tail_or_size_changes_the_key(tmp_path):
    size = 3 * FINGERPRINT_SPAN
    base = gguf_fingerprint(write_file(tmp_path / "base.gguf", size))
    for name, position in (("head.gguf", 10), ("tail.gguf", size - 10)):
        data = bytearray((tmp_path / "base.gguf").read_bytes())
        data[position] ^= 0xFF
        (tmp_path / name).write_bytes(bytes(data))
        assert gguf_fingerprint(tmp_path / name) != base, name
    assert gguf_fingerprint(write_file(tmp_path / "short.gguf", size - 1)) != base


def test_a_file_smaller_than_the_span_is_hashed_whole(tmp_path):
    small = write_file(tmp_path / "small.gguf", 1000)
    other = write_file(tmp_path / "other.gguf", 1000, seed=1)
    assert gguf_fingerprint(small) != gguf_fingerprint(other)
