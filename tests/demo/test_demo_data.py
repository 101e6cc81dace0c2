"""Demo corpus: deterministic split by file, byte windows, errors."""
import hashlib
import os

import pytest
import torch

from gns_kernels.demo.data import (CorpusNotFoundError, TokenWindows, is_validation_file,
                                   load_corpus)


def _write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)


def test_split_by_file_is_deterministic_and_matches_sha1(tmp_path):
    files = {f"pkg{i % 3}/mod{i}.py": f"x = {i}\n" * (i + 1) for i in range(60)}
    files["site-packages/foreign.py"] = "SHOULD NOT BE READ\n"
    files["notes.txt"] = "not python\n"
    _write(tmp_path, files)
    c = load_corpus(str(tmp_path), val_fraction=0.3)
    expect_val = sorted(r for r in files if r.endswith(".py") and not r.startswith("site-")
                        and int(hashlib.sha1(r.encode()).hexdigest()[:8], 16) % 1000 < 300)
    assert c.val_files == len(expect_val) and c.train_files == 60 - len(expect_val)
    # the streams hold exactly the files of their side, sorted, NUL-separated
    val_bytes = b"".join(files[r].encode() + b"\0" for r in expect_val)
    assert bytes(c.val.tolist()) == val_bytes
    assert b"SHOULD NOT" not in bytes(c.train.tolist())
    assert b"not python" not in bytes(c.train.tolist())
    c2 = load_corpus(str(tmp_path), val_fraction=0.3)
    assert torch.equal(c.train, c2.train) and torch.equal(c.val, c2.val)
    assert is_validation_file("a/b.py", 0.3) == is_validation_file("a" + os.sep + "b.py", 0.3)


def test_stdlib_default_corpus_loads():
    c = load_corpus(max_bytes=200_000)
    assert c.train.dtype == torch.uint8 and c.train.numel() >= 200_000
    assert c.val.numel() > 0 and c.val_files >= 1
    assert b"def " in bytes(c.train[:200_000].tolist())


def test_windows():
    stream = torch.arange(0, 23, dtype=torch.uint8)
    w = TokenWindows(stream, 5)
    assert len(w) == 4                      # (23 - 1) // 5
    x, y = w.batch([0, 3])
    assert x.dtype == torch.int64 and x.shape == (2, 5)
    assert x[1].tolist() == [15, 16, 17, 18, 19] and y[1].tolist() == [16, 17, 18, 19, 20]
    assert x[0].tolist() == [0, 1, 2, 3, 4] and y[0].tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(IndexError, match="out of range"):
        w.batch([4])
    assert w.evenly_spaced(3) == [0, 2, 3]
    assert w.evenly_spaced(100) == [0, 1, 2, 3]


def test_errors(tmp_path):
    with pytest.raises(CorpusNotFoundError, match="corpus folder not found"):
        load_corpus(str(tmp_path / "missing"))
    with pytest.raises(CorpusNotFoundError, match="need at least one"):
        load_corpus(str(tmp_path))                   # empty folder
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(str(tmp_path), val_fraction=0.0)
    with pytest.raises(ValueError, match="shorter"):
        TokenWindows(torch.zeros(3, dtype=torch.uint8), 5)
