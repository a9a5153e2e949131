"""Hostile files: altered checkpoints and IDX headers give one ``ValueError`` naming the file,
never a raw exception or unbounded work; atomic writes honour the umask and clear stale temporaries."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

import parconv as pc
from parconv import _checkpoint, _io
from parconv.datasets import IDXError, read_idx

META = _io.META_KEY + ".npy"


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def _write_zip(path, members: dict, compression=zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small training checkpoint (1 epoch done) and its members as bytes."""
    path = tmp_path_factory.mktemp("ck") / "ck.npz"
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend="numpy")
    x = np.random.default_rng(0).standard_normal((8, 1, 2, 2)).astype(np.float32)
    y = np.arange(8) % 2
    model.fit(x, y, batch_size=4, optimizer=pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
              verbose=False, checkpoint=path)
    with zipfile.ZipFile(path) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    meta = json.loads(np.lib.format.read_array(io.BytesIO(members[META])).tobytes())
    return path, members, meta


def _with_meta(members, meta) -> dict:
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return {**members, META: _npy(np.frombuffer(raw, dtype=np.uint8))}


def _fresh():
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=1), backend="numpy")
    return model, pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _use_fully(path):
    """Every reader of a checkpoint: pc.load, and the training state applied to a fresh model."""
    pc.load(path)
    state = _checkpoint.load_training_checkpoint(path)
    model, opt = _fresh()
    _checkpoint.apply_training_state(state, model, opt, np.random.default_rng(0), pc.History())


def _only_value_errors_naming(path, fn):
    """``fn(path)`` succeeds or raises ValueError whose message names ``path``; returns whether it raised."""
    try:
        fn(path)
    except ValueError as exc:
        assert os.fspath(path) in str(exc), str(exc)
        return True
    return False


def _altered(meta, **changes):
    out = json.loads(json.dumps(meta))
    for dotted, value in changes.items():
        where, *keys = dotted.split("__")
        node = out
        for k in [where, *keys][:-1]:
            node = node[k]
        node[[where, *keys][-1]] = value
    return out


META_CASES = {
    "format-string": dict(format="1"),
    "format-null": dict(format=None),
    "format-bool": dict(format=True),
    "format-newer": dict(format=99),
    "model-list": dict(model=[1, 2]),
    "model-unknown-layer": dict(model={"layers": [{"type": "Nope", "config": {}}]}),
    "model-layers-string": dict(model={"layers": "Linear"}),
    "model-bad-config": dict(model={"layers": [{"type": "Flatten", "config": {}},
                                               {"type": "Linear", "config": {"in_features": "4", "out_features": 2}}]}),
    "model-config-list": dict(model={"layers": [{"type": "Linear", "config": [4, 2]}]}),
    "rng-state-string": dict(training__rng_state__state="x"),
    "rng-state-missing": dict(training__rng_state={"bit_generator": "PCG64"}),
    "rng-generator-unknown": dict(training__rng_state__bit_generator="os.system"),
    "rng-state-list": dict(training__rng_state=[1, 2]),
    "history-int": dict(training__history={"epochs": 5}),
    "history-series": dict(training__history={"epochs": [1], "history": {"loss": "low"}}),
    "epoch-zero": dict(training__epoch=0),
    "epoch-float": dict(training__epoch=1.5),
    "step-negative": dict(training__step=-1),
    "optimizer-null": dict(training__optimizer=None),
    "optimizer-step-string": dict(training__optimizer__step="2"),
    "optimizer-hyper-list": dict(training__optimizer__hyper=[0.1]),
    "optimizer-lr-string": dict(training__optimizer__hyper__lr="fast"),
    "optimizer-lr-negative": dict(training__optimizer__hyper__lr=-1.0),
    "optimizer-momentum-list": dict(training__optimizer__hyper__momentum=[0.9]),
    "optimizer-hyper-unknown": dict(training__optimizer__hyper__betas=[0.9, 0.99]),
    "optimizer-type-other": dict(training__optimizer__type="Adam"),
    "training-list": dict(training=[]),
    "fit-string": dict(training__fit="n=8"),
    "loss-sum-string": dict(training__loss_sum="0"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_altered_metadata_is_one_value_error_naming_the_file(tmp_path, checkpoint, case):
    _, members, meta = checkpoint
    path = tmp_path / f"{case}.npz"
    _write_zip(path, _with_meta(members, _altered(meta, **META_CASES[case])))
    assert _only_value_errors_naming(path, _use_fully)


def test_training_metadata_does_not_stop_a_model_load(tmp_path, checkpoint):
    """pc.load reads the model only: a training checkpoint with a broken training record still loads as a model."""
    _, members, meta = checkpoint
    path = tmp_path / "x.npz"
    _write_zip(path, _with_meta(members, _altered(meta, training__history={"epochs": 5})))
    assert pc.load(path)[1].out_features == 2
    with pytest.raises(ValueError, match="x.npz.*history.epochs"):
        _checkpoint.load_training_checkpoint(path)


def _npy_header(descr: str, shape: str) -> bytes:
    """A version 1.0 ``.npy`` header with any shape text, no data."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}".encode()
    text = text.ljust(117 if len(text) < 117 else len(text) + 1) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def _hostile_archives(members, meta):
    deep = b'{"format": 1, "model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = b'{"format": 1, "model": {"a": ' + b"[" * 200 + b"]" * 200 + b"}}"
    return {
        "member-without-npy": {**members, "notes.txt": b"hello"},
        "member-named-npy-only": {**members, ".npy": _npy(np.zeros(2, np.float32))},
        "no-metadata": {k: v for k, v in members.items() if k != META},
        "metadata-not-bytes": {**members, META: _npy(np.zeros(3, np.float32))},
        "metadata-not-json": _with_meta(members, b"{not json"),
        "metadata-not-utf8": _with_meta(members, b'{"format": "\xff"}'),
        "metadata-array": _with_meta(members, b"[1, 2]"),
        "metadata-deep": _with_meta(members, deep),
        "metadata-nested": _with_meta(members, nested),
        "object-array": {**members, "1.weight.npy": _npy_header("|O", "(1,)") + b"\x80\x04N."},
        "huge-shape": {**members, "1.weight.npy": _npy_header("<f4", "(1099511627776,)")},
        "overflowing-shape": {**members, "1.weight.npy": _npy_header("<f4", "(4294967296, 4294967296, 4294967296)")},
        "negative-shape": {**members, "1.weight.npy": _npy_header("<f4", "(-2, 4)")},
        "bool-shape": {**members, "1.weight.npy": _npy_header("<f4", "(True,)")},
        "structured": {**members, "1.weight.npy": _npy_header("[('a', '<f4')]", "(2, 4)") + bytes(32)},
        "bad-npy-header": {**members, "1.weight.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': (((( }\n"},
        "python2-header": {**members, "1.weight.npy": b"\x93NUMPY\x01\x00\x10\x00{'shape': (2L,)}\n"},
        "not-npy": {**members, "1.weight.npy": b"just bytes"},
        "int-weights": {**members, "1.weight.npy": _npy(np.zeros((2, 4), np.int32))},
        "bad-optimizer-key": {**members, "extra.optim.state.x.y.npy": _npy(np.zeros(2, np.float32))},
        "optimizer-index-out-of-range": {**members, "extra.optim.state.7.momentum_buffer.npy":
                                         _npy(np.zeros(2, np.float32))},
        "weight-shape": {**members, "1.weight.npy": _npy(np.zeros((3, 4), np.float32))},
    }


@pytest.mark.parametrize("case", ["member-without-npy", "member-named-npy-only", "no-metadata", "metadata-not-bytes",
                                  "metadata-not-json", "metadata-not-utf8", "metadata-array", "metadata-deep",
                                  "metadata-nested", "object-array", "huge-shape", "overflowing-shape",
                                  "negative-shape", "bool-shape", "structured",
                                  "bad-npy-header", "python2-header", "not-npy", "int-weights",
                                  "bad-optimizer-key", "optimizer-index-out-of-range", "weight-shape"])
def test_altered_members_are_one_value_error_naming_the_file(tmp_path, checkpoint, case):
    _, members, meta = checkpoint
    path = tmp_path / f"{case}.npz"
    _write_zip(path, _hostile_archives(members, meta)[case])
    tracemalloc.start()
    try:
        assert _only_value_errors_naming(path, _use_fully)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20  # nothing allocated for a size the file does not hold
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA, 99])
def test_unsupported_compression(tmp_path, checkpoint, method):
    _, members, _ = checkpoint
    path = tmp_path / "c.npz"
    if method == 99:  # an unknown method number: patch the stored archive's headers
        _write_zip(path, members)
        raw = bytearray(path.read_bytes())
        for sig, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
            at = raw.find(sig)
            while at >= 0:
                raw[at + offset:at + offset + 2] = struct.pack("<H", 99)
                at = raw.find(sig, at + 4)
        path.write_bytes(bytes(raw))
    else:
        _write_zip(path, members, method)
    with pytest.raises(ValueError, match=r"c\.npz.*compression method"):
        pc.load(path)


def test_deflated_checkpoints_load_and_bombs_do_not(tmp_path, checkpoint):
    _, members, _ = checkpoint
    path = tmp_path / "deflated.npz"
    _write_zip(path, members, zipfile.ZIP_DEFLATED)
    assert pc.load(path)[1].in_features == 4
    # a member whose directory entry claims far more than deflate can produce from its bytes
    bomb = tmp_path / "bomb.npz"
    _write_zip(bomb, {**members, "big.npy": _npy(np.zeros(1 << 20, np.uint8))}, zipfile.ZIP_DEFLATED)
    raw = bytearray(bomb.read_bytes())
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46:at + 46 + name_len] == b"big.npy":
            struct.pack_into("<I", raw, at + 24, 0xFFFFFFF0)  # uncompressed size
        at = raw.find(b"PK\x01\x02", at + 4)
    bomb.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"bomb\.npz.*more than deflate can produce"):
        pc.load(bomb)


@pytest.mark.parametrize("content", [b"", b"x", b"\x93", b"PK", b"PK\x05\x06" + bytes(18), b"\x80\x04N."])
def test_tiny_and_foreign_files(tmp_path, content):
    path = tmp_path / "tiny.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="tiny.npz") as info:
        pc.load(path)
    assert "pickle" not in str(info.value)


def test_plain_npy_and_directory(tmp_path):
    npy = tmp_path / "weights.npy"
    np.save(npy, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"weights\.npy.*plain \.npy array"):
        pc.load(npy)
    with pytest.raises(ValueError, match=r"weights\.npy"):
        _checkpoint.load_training_checkpoint(npy)
    with pytest.raises(ValueError, match="is a directory"):
        pc.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        pc.load(tmp_path / "missing.npz")


def test_fit_resume_from_an_altered_checkpoint_names_the_file(tmp_path, checkpoint):
    _, members, meta = checkpoint
    path = tmp_path / "bad-rng.npz"
    _write_zip(path, _with_meta(members, _altered(meta, training__rng_state__state={"state": 1})))
    model, opt = _fresh()
    x, y = np.zeros((8, 1, 2, 2), np.float32), np.arange(8) % 2
    with pytest.raises(ValueError, match=r"bad-rng\.npz.*rng_state"):
        model.fit(x, y, batch_size=4, epochs=2, optimizer=opt, verbose=False, resume=path)


# ------------------------------------------------------------------ byte-level fuzzing

def _central_directory(raw: bytes) -> int:
    return raw.index(b"PK\x01\x02")


def test_fuzz_every_byte_of_the_zip_directory(tmp_path, checkpoint):
    """Each byte of the central directory and end records flipped in its low bit and in all bits, one at a time."""
    src, _, _ = checkpoint
    raw = src.read_bytes()
    path = tmp_path / "fuzz.npz"
    start = _central_directory(raw)
    failed = loaded = 0
    for i in range(start, len(raw)):
        for value in (raw[i] ^ 0x01, raw[i] ^ 0xFF):
            path.write_bytes(raw[:i] + bytes([value]) + raw[i + 1:])
            if _only_value_errors_naming(path, _use_fully):
                failed += 1
            else:
                loaded += 1
    assert failed and loaded  # some changes (a timestamp, an attribute) are harmless


def test_fuzz_every_byte_of_the_metadata(tmp_path, checkpoint):
    """Each byte of the metadata JSON replaced by a digit or a character that changes its structure, in turn."""
    _, members, meta = checkpoint
    text = json.dumps(meta).encode()
    path = tmp_path / "fuzz.npz"
    failed = loaded = 0
    for i in range(len(text)):
        value = b'7"}[-x\xff0'[i % 8]
        if value != text[i]:
            _write_zip(path, _with_meta(members, text[:i] + bytes([value]) + text[i + 1:]))
            if _only_value_errors_naming(path, _use_fully):
                failed += 1
            else:
                loaded += 1
    assert failed and loaded


def _idx(array, type_code=0x08) -> bytes:
    return struct.pack(">HBB", 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) \
        + array.tobytes()


_TYPE_CODES = (0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
def test_fuzz_every_byte_of_an_idx_header(tmp_path, compress):
    """Each header byte set to every type code, small and extreme values: a clean load or an IDXError naming it."""
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    good = _idx(arr)
    path = tmp_path / ("f.idx.gz" if compress else "f.idx")
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(16):
        for value in sorted({*range(4), *_TYPE_CODES, 0x7F, 0x80, 0xFF, good[i] ^ 0x01} - {good[i]}):
            data = good[:i] + bytes([value]) + good[i + 1:]
            path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
            try:
                got = read_idx(path)
            except IDXError as exc:
                assert str(path) in str(exc)
                outcomes["refused"] += 1
            else:
                assert got.size == arr.size
                outcomes["loaded"] += 1
    assert outcomes["loaded"] and outcomes["refused"]  # e.g. uint8 <-> int8, (2, 3, 4) <-> (4, 3, 2)


def test_idx_sizes_past_64_bits_name_the_file(tmp_path):
    path = tmp_path / "huge.idx"
    path.write_bytes(struct.pack(">HBB3I", 0, 0x08, 3, 2**22, 2**21, 2**21))
    with pytest.raises(IDXError, match=r"huge\.idx: file truncated.*\(4194304, 2097152, 2097152\)"):
        read_idx(path)
    path.write_bytes(struct.pack(">HBB3I", 0, 0x0E, 3, 2**32 - 1, 2**32 - 1, 2**32 - 1))
    with pytest.raises(IDXError, match=r"huge\.idx"):
        read_idx(path)


def _gzip_stream(header: bytes, zeros: int) -> bytes:
    c = zlib_compressobj()
    parts = [c.compress(header)]
    chunk = bytes(1 << 20)
    for _ in range(zeros >> 20):
        parts.append(c.compress(chunk))
    parts.append(c.flush())
    return b"".join(parts)


def zlib_compressobj():
    import zlib

    return zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)


def test_idx_gzip_is_inflated_no_further_than_the_header_promises(tmp_path):
    path = tmp_path / "bomb.idx.gz"
    # the header promises 1 MiB; the stream inflates to 48 MiB
    path.write_bytes(_gzip_stream(struct.pack(">HBBI", 0, 0x08, 1, 1 << 20), 48 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(IDXError, match=r"bomb\.idx\.gz: file has trailing bytes"):
            read_idx(path)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    # a header promising 2**30 items from a small gzip is refused before inflating anything
    path.write_bytes(_gzip_stream(struct.pack(">HBBI", 0, 0x08, 1, 1 << 30), 1 << 20))
    t0 = time.perf_counter()
    with pytest.raises(IDXError, match=r"bomb\.idx\.gz: header promises.*cannot hold"):
        read_idx(path)
    assert time.perf_counter() - t0 < 1.0


def test_idx_truncated_gzip_and_multi_member(tmp_path):
    arr = np.arange(60, dtype=np.uint8).reshape(3, 4, 5)
    data = _idx(arr)
    path = tmp_path / "m.idx.gz"
    path.write_bytes(gzip.compress(data[:10]) + gzip.compress(data[10:]))  # gzip allows concatenated members
    np.testing.assert_array_equal(read_idx(path), arr)
    path.write_bytes(gzip.compress(data)[:-6])
    with pytest.raises(IDXError, match=r"m\.idx\.gz: corrupt or truncated gzip"):
        read_idx(path)


# ------------------------------------------------------------------ atomic writes

def _umask_run(tmp_path, umask: int, code: str) -> None:
    script = f"import os\nos.umask({umask:#o})\n{code}"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pc.__file__)))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_saved_files_honour_the_umask(tmp_path, umask):
    code = ("import parconv as pc, numpy as np\n"
            "m = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend='numpy')\n"
            "m.save('model.npz')\n"
            "m.fit(np.zeros((4, 1, 2, 2), np.float32), np.zeros(4, int), batch_size=2, verbose=False,\n"
            "      optimizer=pc.optim.SGD(m.parameters(), lr=0.1), checkpoint='ck.npz')\n"
            "from parconv._io import atomic_open\n"
            "with atomic_open('bench.json', 'w') as f: f.write('{}')\n")
    _umask_run(tmp_path, umask, code)
    for name in ("model.npz", "ck.npz", "bench.json"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask, name
    assert not list(tmp_path.glob(".parconv-*"))


def test_umask_is_read_without_changing_it():
    before = os.umask(0o027)
    try:
        assert _io._current_umask() == 0o027
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(before)


def test_stale_temporaries_are_removed_at_the_next_save(tmp_path):
    stale = tmp_path / ".parconv-killed.tmp"
    fresh = tmp_path / ".parconv-writing.tmp"
    other = tmp_path / ".other-old.tmp"
    for p in (stale, fresh, other):
        p.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    os.mkdir(tmp_path / ".parconv-dir.tmp")
    os.utime(tmp_path / ".parconv-dir.tmp", (old, old))
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend="numpy")
    model.save(tmp_path / "m.npz")
    assert not stale.exists()
    assert fresh.exists() and other.exists() and (tmp_path / ".parconv-dir.tmp").is_dir()  # a live writer's
    assert pc.load(tmp_path / "m.npz")[1].out_features == 2


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.npz"
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend="numpy")
    model.save(path)
    before = path.read_bytes()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        model.save(path)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".parconv-*"))


def test_check_writable_target(tmp_path):
    _io.check_writable_target(tmp_path / "new" / "dir" / "ck.npz")
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        _io.check_writable_target(tmp_path / "file" / "ck.npz")
    with pytest.raises(IsADirectoryError):
        _io.check_writable_target(tmp_path)


def test_training_checkpoint_with_an_integer_counter_resumes(tmp_path):
    """BatchNorm's num_batches_tracked is an integer array: a checkpoint holding it is not hostile."""
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 3, rng=0), pc.BatchNorm1d(3), pc.Linear(3, 2, rng=1),
                          backend="numpy")
    x = np.random.default_rng(0).standard_normal((8, 1, 2, 2)).astype(np.float32)
    path = tmp_path / "bn.npz"
    model.fit(x, np.arange(8) % 2, batch_size=4, optimizer=pc.optim.SGD(model.parameters(), lr=0.1),
              verbose=False, checkpoint=path)
    state = _checkpoint.load_training_checkpoint(path)
    assert state.model_state["2.num_batches_tracked"].dtype.kind in "iu"
    assert pc.load(path)[2].num_features == 3


@pytest.mark.parametrize("betas", [5, "x", [0.9], [0.9, 0.99, 0.999], [2.0, 0.9], None])
def test_altered_adam_hyperparameters(tmp_path, betas):
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend="numpy")
    x, y = np.zeros((8, 1, 2, 2), np.float32), np.arange(8) % 2
    path = tmp_path / "adam.npz"
    model.fit(x, y, batch_size=4, optimizer=pc.optim.Adam(model.parameters(), lr=0.01), verbose=False,
              checkpoint=path)
    with zipfile.ZipFile(path) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    meta = json.loads(np.lib.format.read_array(io.BytesIO(members[META])).tobytes())
    _write_zip(path, _with_meta(members, _altered(meta, training__optimizer__hyper__betas=betas)))
    fresh = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=1), backend="numpy")
    with pytest.raises(ValueError, match=r"adam\.npz"):
        fresh.fit(x, y, batch_size=4, epochs=2, optimizer=pc.optim.Adam(fresh.parameters(), lr=0.01),
                  verbose=False, resume=path)


@pytest.mark.parametrize("case", ["weight-shape", "int-weights", "huge-shape", "bad-optimizer-key"])
def test_hostile_members_on_every_backend(tmp_path, checkpoint, backend, case):
    """The checks run before any array reaches a backend: the same error wherever the model would live."""
    src, members, meta = checkpoint
    assert pc.load(src, backend=backend.name)[1].backend.name == backend.name
    path = tmp_path / f"{case}.npz"
    _write_zip(path, _hostile_archives(members, meta)[case])
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=1), backend=backend.name)
    x, y = np.zeros((8, 1, 2, 2), np.float32), np.arange(8) % 2
    with pytest.raises(ValueError, match=rf"{case}\.npz"):
        if case == "bad-optimizer-key":
            model.fit(x, y, batch_size=4, epochs=2, optimizer=pc.optim.SGD(model.parameters(), lr=0.1,
                                                                            momentum=0.9),
                      verbose=False, resume=path)
        else:
            pc.load(path, backend=backend.name)


# ------------------------------------------------------------------ promised sizes and non-regular files

@pytest.mark.parametrize("config", [
    {"in_features": 30000, "out_features": 30000},  # 3.6e9 bytes of initial weights for a 1 kB file
    {"in_features": 4, "out_features": 2**40},
])
def test_model_description_bigger_than_the_file_is_refused_before_allocating(tmp_path, checkpoint, config):
    src, members, meta = checkpoint
    altered = _altered(meta, model__layers=[{"type": "Flatten", "config": {}},
                                            {"type": "Linear", "config": {**config, "bias": True}}])
    path = tmp_path / "promise.npz"
    _write_zip(path, _with_meta(members, altered))
    assert path.stat().st_size < 4096
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"promise\.npz.*promises more parameters than the file holds.*"
                                             r"Linear"):
            pc.load(path)
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_descriptions_without_stored_values_still_load(tmp_path):
    # a BatchNorm without weights or statistics stores nothing; the bound must not refuse it
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2), pc.BatchNorm1d(2, affine=False, track_running_stats=False),
                          backend="numpy")
    model.save(tmp_path / "m.npz")
    assert len(pc.load(tmp_path / "m.npz", backend="numpy")) == 3


def _cifar_records(n: int) -> bytes:
    return (np.arange(n * 3073) % 10).astype(np.uint8).tobytes()  # record starts are labels 0..9


def _cifar_archive(path, members) -> None:
    """A tar.gz of ``{name: bytes or a TarInfo-editing callable}`` under cifar-10-batches-bin/."""
    import tarfile

    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name if "/" in name else f"cifar-10-batches-bin/{name}")
            if callable(content):
                content(info)
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))


def _cifar_refused(path, match, limit=16 << 20):
    from parconv.datasets import load_cifar10

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=match):
            load_cifar10("test", path=path)
        assert tracemalloc.get_traced_memory()[1] < limit
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0


def test_cifar_archive_member_bigger_than_a_batch_is_not_read(tmp_path):
    # a 1 MB archive used to be read to 1 GB; here a member of 40 MB (30.73 MB is a full batch file)
    zeros = bytes(40_000_000)
    _cifar_archive(tmp_path / "cifar-10-binary.tar.gz", {"test_batch.bin": zeros})
    assert (tmp_path / "cifar-10-binary.tar.gz").stat().st_size < 1 << 20
    _cifar_refused(tmp_path, r"cifar-10-binary\.tar\.gz: cifar-10-batches-bin/test_batch\.bin claims 40000000 "
                             r"bytes, more than a CIFAR-10 batch file holds \(30730000")


def test_cifar_archive_symlink_member_is_a_clear_error(tmp_path):
    # a symbolic link member raised KeyError from tarfile
    def link(info):
        import tarfile

        info.type, info.linkname = tarfile.SYMTYPE, "/dev/zero"

    _cifar_archive(tmp_path / "cifar-10-binary.tar.gz", {"test_batch.bin": link})
    _cifar_refused(tmp_path, r"cifar-10-batches-bin/test_batch\.bin is a symbolic link, expected a regular file")


def test_cifar_archive_search_is_bounded(tmp_path):
    members = {f"junk/{i}": b"x" for i in range(100)}
    members["test_batch.bin"] = _cifar_records(2)
    _cifar_archive(tmp_path / "cifar-10-binary.tar.gz", members)
    _cifar_refused(tmp_path, r"has no cifar-10-batches-bin/test_batch\.bin among its first 64 entries")


def test_cifar_batch_file_bigger_than_a_batch_is_not_read(tmp_path):
    from parconv.datasets import load_cifar10

    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    with open(folder / "test_batch.bin", "wb") as f:
        f.truncate(10**9)  # sparse: no disk used; was read whole
    _cifar_refused(tmp_path, r"test_batch\.bin: 1000000000 bytes, more than a CIFAR-10 batch file holds")
    (folder / "test_batch.bin").write_bytes(_cifar_records(3))
    assert load_cifar10("test", path=tmp_path)[0].shape == (3, 3, 32, 32)


def _in_subprocess(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter (a reader that blocks fails the test instead of hanging it)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_non_regular_files_are_refused_without_blocking(tmp_path):
    # a FIFO blocked every reader forever; a link to /dev/zero read until MemoryError
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    os.mkfifo(folder / "test_batch.bin")
    os.mkfifo(tmp_path / "pipe.npz")
    os.mkfifo(tmp_path / "pipe-idx")
    archive_dir = tmp_path / "archive"
    archive_dir.mkdir()
    os.mkfifo(archive_dir / "cifar-10-binary.tar.gz")
    zero_dir = tmp_path / "zero" / "cifar-10-batches-bin"
    zero_dir.mkdir(parents=True)
    os.symlink("/dev/zero", zero_dir / "test_batch.bin")
    out = _in_subprocess(f"""
import parconv as pc
from parconv.datasets import load_cifar10, read_idx
calls = [lambda: load_cifar10("test", path={str(tmp_path)!r}),
         lambda: load_cifar10("test", path={str(archive_dir)!r}),
         lambda: load_cifar10("test", path={str(archive_dir)!r}, download=True),
         lambda: load_cifar10("test", path={str(tmp_path / "zero")!r}),
         lambda: pc.load({str(tmp_path / "pipe.npz")!r}),
         lambda: read_idx({str(tmp_path / "pipe-idx")!r})]
for call in calls:
    try:
        call()
        print("loaded")
    except ValueError as exc:
        print(exc)
""")
    lines = out.splitlines()
    assert len(lines) == 6, out
    assert "test_batch.bin': the CIFAR-10 batch file is a FIFO (named pipe); expected a regular file" in lines[0]
    assert "cifar-10-binary.tar.gz': the CIFAR-10 archive is a FIFO" in lines[1]
    assert "cifar-10-binary.tar.gz': " in lines[2] and "is a FIFO" in lines[2]  # before its checksum is read
    assert "test_batch.bin': the CIFAR-10 batch file is a character device" in lines[3]
    assert "pipe.npz" in lines[4] and "FIFO" in lines[4]
    assert "pipe-idx': the IDX file is a FIFO" in lines[5]


@pytest.mark.parametrize("loader", ["mnist", "fashion"])
def test_idx_labels_past_nine_are_refused(tmp_path, loader):
    # MNIST and Fashion-MNIST took label 200 (CIFAR-10 refuses it)
    from parconv.datasets import load_fashion_mnist, load_mnist
    from parconv.datasets.fashion_mnist import FASHION_MNIST_FILES
    from parconv.datasets.mnist import MNIST_FILES

    files = (FASHION_MNIST_FILES if loader == "fashion" else MNIST_FILES)["train"]
    images = np.zeros((3, 28, 28), np.uint8)
    labels = np.array([1, 200, 3], np.uint8)
    for name, arr in zip(files, (images, labels)):
        (tmp_path / name).write_bytes(gzip.compress(_idx(arr)))
    load = load_fashion_mnist if loader == "fashion" else load_mnist
    with pytest.raises(IDXError, match=r"labels-idx1-ubyte\.gz: corrupt: label 1 is 200 \(labels are 0\.\.9"):
        load("train", path=tmp_path)
    labels[1] = 9
    (tmp_path / files[1]).write_bytes(gzip.compress(_idx(labels)))
    assert load("train", path=tmp_path)[1].tolist() == [1, 9, 3]


def test_offline_download_says_where_to_put_the_file(tmp_path):
    from parconv.datasets import _download

    target = tmp_path / "data" / "thing.tar.gz"
    with pytest.raises(OSError) as info:
        _download.fetch([(tmp_path / "absent.tar.gz").as_uri()], str(target), "0" * 32)
    message = str(info.value)
    assert "could not download thing.tar.gz" in message and "absent.tar.gz" in message
    assert f"copy it to {target}" in message and "0" * 32 in message
