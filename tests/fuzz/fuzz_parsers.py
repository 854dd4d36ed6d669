"""Coverage-guided fuzzing (atheris) of kvstore's parsers: the envelope header,
the payload header, the manifest JSON and the trailer sections.

    pip install atheris                    # or: pip install -e ".[fuzz]"
    python tests/fuzz/fuzz_parsers.py -max_total_time=600 [CORPUS_DIR]

Each input is one of four shapes, chosen by its first byte: a raw 48-byte
header (compared with the pure-Python reference parser), a raw manifest, a raw
trailer, or a known-good checkpoint file with one to four mutations applied
(bit flips, truncations, inserted or deleted bytes, length fields set near
2**32 and 2**64, a fuzzed manifest or trailer put in with a valid CRC, a
structured manifest edit).  Every file goes through every reader the store
has, and the checks in check_file hold for all of them:

- only KVStoreError subclasses come out of a parser (parse_trailer and
  KVStore.load never raise: a bad file is a miss);
- a file load() accepts is one verify_file() accepts and vice versa, and what
  load() returns is what the manifest describes, byte for byte;
- a mutated file that still loads, with its manifest's CRC never recomputed,
  loads the original tensors (a corrupt file is never loaded as good).

The module imports without atheris: tests/test_fuzz.py runs the same checks
from hypothesis, and runs this target for a few seconds so it keeps working.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import struct
import sys
import tempfile

if __name__ == "__main__":
    import atheris
    _instrumented = atheris.instrument_imports(include=["kvstore"])
else:
    _instrumented = contextlib.nullcontext()

with _instrumented:
    import numpy as np

    import kvstore
    from kvstore import payload, trailers
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # tests/: its helpers
    import reference as _reference
    from kvhelpers import index_of
    from kvstore import files
    from kvstore.errors import CorruptCheckpoint, KVStoreError
    from kvstore.format import PREFIX_SIZE, Entry, Header, read_entry
    from kvstore.reader import Match

PAYLOAD_HEAD = struct.Struct("<4sIQII")

# Values a length or offset field is set to: the edges of u32 and u64, where
# sums overflow in C, and small ones.
EDGES = (0, 1, 2, 23, 24, 4095, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1,
         2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1)

# Values a manifest field is set to by a structured edit.
JSON_VALUES = (0, 1, -1, 63, 64, 4096, 2**31, 2**32 - 1, 2**32, 2**53, 2**63, 2**64, 2**64 - 1, 10**30,
               1.5, -0.0, True, False, None, "", "float16", "object", "../../etc/passwd", [], [0],
               [2**62, 0], [0, 2**63], [2**31] * 4, [1] * 17, {}, {"a": 1})


def original_tensors():
    rng = np.random.default_rng(7)
    return {"k": rng.standard_normal((3, 40)).astype(np.float16),
            "v": rng.integers(0, 2**31, size=(5, 7), dtype=np.int64).astype(np.uint32),
            "s": np.float32(2.5),
            "e": np.zeros((0, 9), np.int8)}


ORIGINAL_TEXT = b"a fuzzing prompt \xe2\x9c\x93"
ORIGINAL_TOKENS = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.uint32)


class Target:
    """A scratch store directory and the known-good file the mutations start from."""

    def __init__(self, base=None):
        base = base or ("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
        self.dir = tempfile.mkdtemp(prefix="kvstore-fuzz-", dir=base)
        opts = dict(min_tokens=1, cold_max_tokens=2**32 - 1)
        # The whole-file layout (ABI 16): the parsers under test are the
        # envelope's, the payload's and the trailer's; tests/test_chain.py
        # damages chain blocks.
        self.store = kvstore.KVStore(os.path.join(self.dir, "kv"), **opts, durable=False,
                                     budget_mb=0, layout="whole")
        e = self.store.save(ORIGINAL_TEXT, ORIGINAL_TOKENS, original_tensors(), meta={"engine": "fuzz"},
                            trailers={0: {"call_1": "{\"tool\": 1}"}, 3: "a title"})
        with open(e.path, "rb") as f:
            self.good = f.read()
        os.unlink(e.path)
        index_of(self.store).discard(e.name)
        self.entry = read_entry_from_bytes(self.good)
        self.name = e.name

    def close(self):
        self.store.close()
        for root, dirs, files in os.walk(self.dir, topdown=False):
            for n in files:
                os.unlink(os.path.join(root, n))
            for n in dirs:
                os.rmdir(os.path.join(root, n))
        os.rmdir(self.dir)


def read_entry_from_bytes(blob):
    """The Entry fields of a well-formed blob (the envelope of the good file)."""
    h = Header.unpack(blob)
    (tl,) = struct.unpack_from("<I", blob, 48)
    return Entry(sha="", path="<memory>", quant_bits=h.quant_bits, reason=h.reason, ext_flags=h.ext_flags,
                 model_id=h.model_id, tokens=h.tokens, hits=h.hits, ctx_size=h.ctx_size,
                 payload_abi=h.payload_abi, created_at=h.created_at, last_used=h.last_used,
                 payload_bytes=h.payload_bytes, text_bytes=tl, file_size=len(blob))


# ---- the checks -------------------------------------------------------------------

def check_header(buf):
    """Header.unpack agrees with the reference parser, and only CorruptCheckpoint escapes."""
    try:
        ref = _reference.parse_header(buf)
    except ValueError:
        ref = None
    try:
        h = Header.unpack(buf)
    except CorruptCheckpoint:
        assert ref is None or ref[1] not in kvstore.format.VALID_QUANT_BITS, ref
        return None
    assert ref is not None
    assert (h.version, h.quant_bits, h.ext_flags, h.model_id, h.tokens, h.hits, h.ctx_size,
            h.payload_abi, h.created_at, h.last_used, h.payload_bytes) == \
        (ref[0], ref[1], ref[3], ref[4], ref[5], ref[6], ref[7], ref[8], ref[9], ref[10], ref[11])
    assert h.reason == (ref[2] if ref[2] <= 6 else 0)
    assert h.pack()[:5] == bytes(buf[:5])
    return h


def check_manifest(raw, entry, data_offset):
    """Manifest either raises CorruptCheckpoint or describes blocks that can be read as arrays."""
    try:
        m = payload.Manifest(raw, entry, data_offset)
    except CorruptCheckpoint:
        return None
    blocks = [(m.tokens[0], 4 * entry.tokens)] + [(t[3], t[4]) for t in m.tensors]
    for off, n in blocks:
        assert data_offset <= off and off + n <= entry.payload_bytes, (off, n)
    blocks.sort()
    for (o1, n1), (o2, _) in zip(blocks, blocks[1:]):
        assert o1 + n1 <= o2
    for name, dtype, shape, off, n, crc in m.tensors:
        assert math.prod(shape) * payload.DTYPES[dtype][0] == n
        # The reader allocates exactly this: it must be creatable, and no larger than the file.
        a = np.empty(shape, dtype=payload.numpy_dtype(dtype))
        assert a.nbytes == n
    assert isinstance(m.meta, dict)
    return m


def check_trailer(raw):
    """parse_trailer never raises, and what it keeps encodes back to the same values."""
    values, sections, flags = trailers.parse_trailer(raw, None, _QUIET)
    assert flags == sum(1 << s.bit for s in sections)
    assert set(values) <= {s.bit for s in sections}
    if values or sections:
        again, _ = trailers.encode_trailer(values, sections)
        values2, _, flags2 = trailers.parse_trailer(again, None, _QUIET)
        assert values2 == values and flags2 == flags
    return values


def _text_of(blob):
    if len(blob) < PREFIX_SIZE:
        return b""
    (tl,) = struct.unpack_from("<I", blob, 48)
    return bytes(blob[PREFIX_SIZE:PREFIX_SIZE + tl])


def check_file(target, blob, expect_original=False, name=None):
    """Runs every reader on blob stored as a checkpoint in the target's store.

    Args:
        target: a Target.
        blob: the file's bytes.
        expect_original: the manifest's CRC was never recomputed, so a load
            that succeeds must return the original tokens and tensors.
        name: the file name; default: the name of the text the blob holds
            (a mutated text then still matches its name, and parsing goes on).

    Returns:
        "loaded", "refused" or "not_eligible".
    """
    text = _text_of(blob)
    name = name or kvstore.format.sha1(text).hex() + ".kv"
    path = os.path.join(target.store.path, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, blob)
    finally:
        os.close(fd)
    try:
        return _check_path(target, path, blob, text, expect_original)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        index_of(target.store).discard(name)


def _check_path(target, path, blob, text, expect_original):
    try:
        entry = read_entry(path)
    except KVStoreError:
        entry = None
    verdict = files.verify_file(path)
    if entry is None:
        assert verdict is not None
        return "refused"
    assert entry.file_size == len(blob) and entry.trailer_offset <= len(blob)
    manifest = None
    with open(path, "rb") as f:
        fd = f.fileno()
        for bit, at, n, crc in trailers.trailer_sections(fd, entry):
            assert entry.trailer_offset <= at and at + n <= len(blob)
        if entry.loadable:
            try:
                manifest = payload.read_manifest(fd, entry)
            except CorruptCheckpoint:
                pass
    check_trailer(blob[entry.trailer_offset:])
    if not entry.loadable:
        assert verdict is None            # a foreign ABI is a valid envelope
        return "not_eligible"
    if manifest is None:
        assert verdict is not None
    if entry.model_id != target.store.settings.model_id:
        return "not_eligible"
    # Straight to load, as find() would hand it over (the lookup itself is
    # test_lookup.py's): the prompt continues the stored text.
    found = Match.of(entry, text + b"+")
    ck = target.store.load(found)
    if ck is None:
        assert verdict is not None, "verify_file accepts a file that load refuses"
        return "refused"
    assert verdict is None, f"load accepted a file verify_file refuses: {verdict}"
    assert manifest is not None and ck.text_bytes == text
    P = entry.payload_offset
    toff, _, _ = manifest.tokens
    assert ck.tokens.dtype == np.uint32 and ck.tokens.size == entry.tokens
    assert ck.tokens.tobytes() == blob[P + toff:P + toff + 4 * entry.tokens]
    assert list(ck.tensors) == [t[0] for t in manifest.tensors]
    for name, dtype, shape, off, n, crc in manifest.tensors:
        a = ck.tensors[name]
        assert a.shape == shape and a.dtype == payload.numpy_dtype(dtype)
        assert a.tobytes() == blob[P + off:P + off + n]
    if expect_original:
        assert np.array_equal(ck.tokens, ORIGINAL_TOKENS)
        want = original_tensors()
        assert sorted(ck.tensors) == sorted(want)
        for k, v in want.items():
            assert ck.tensors[k].dtype == v.dtype and np.array_equal(ck.tensors[k], v), k
    return "loaded"


class _Quiet(logging.Logger):
    def __init__(self):
        super().__init__("kvstore-fuzz", logging.CRITICAL + 1)


_QUIET = _Quiet()


# ---- mutations of the good file ---------------------------------------------------

def _fix_manifest(blob, raw):
    """Puts raw in as the manifest (keeping the data offset) with a valid CRC; False if it cannot fit."""
    if len(blob) < PREFIX_SIZE:
        return False
    (tl,) = struct.unpack_from("<I", blob, 48)
    P = PREFIX_SIZE + tl
    if len(blob) < P + 24:
        return False
    magic, mlen, doff, _, res = PAYLOAD_HEAD.unpack_from(blob, P)
    if 24 + len(raw) > doff or P + 24 + len(raw) > len(blob):
        return False
    blob[P:P + 24] = PAYLOAD_HEAD.pack(magic, len(raw), doff, kvstore.format.crc32c(raw), res)
    blob[P + 24:P + 24 + len(raw)] = raw
    return True


def _manifest_of(blob):
    (tl,) = struct.unpack_from("<I", blob, 48)
    P = PREFIX_SIZE + tl
    _, mlen, _, _, _ = PAYLOAD_HEAD.unpack_from(blob, P)
    return json.loads(bytes(blob[P + 24:P + 24 + mlen]))


def _structured_edit(m, pick, value):
    """Sets (or deletes, for value Ellipsis) one field chosen by pick."""
    blocks = [m["tokens"]] + m["tensors"]
    keys = ["offset", "nbytes", "crc32c", "count", "dtype", "shape", "name"]
    b = blocks[pick % len(blocks)]
    k = keys[(pick // len(blocks)) % len(keys)]
    top = pick % 11
    if top == 7:
        m["tensors"].append(dict(m["tensors"][0]))           # a second block at the same offset
    elif top == 8:
        m["tensors"][0]["offset"], m["tensors"][1]["offset"] = m["tensors"][1]["offset"], m["tensors"][0]["offset"]
    elif top == 9:
        m[("version", "tokens", "tensors", "meta")[pick % 4]] = value
    elif value is Ellipsis:
        b.pop(k, None)
    else:
        b[k] = value


def mutate(target, ops):
    """Applies ops (a list of (kind, a, b, payload bytes)) to a copy of the good file.

    Returns:
        (blob, manifest_recomputed)
    """
    blob = bytearray(target.good)
    recomputed = False
    e = target.entry
    fields = [(48, 4), (40, 8), (8, 4), (e.payload_offset + 4, 4), (e.payload_offset + 8, 8),
              (e.payload_offset + 16, 4), (e.trailer_offset + 4, 8), (e.trailer_offset + 12, 4)]
    for kind, a, b, data in ops:
        kind %= 8
        n = len(blob)
        if kind == 0 and n:                                     # bit flip
            blob[a % n] ^= 1 << (b % 8)
        elif kind == 1:                                         # truncation
            del blob[a % (n + 1):]
        elif kind == 2:                                         # a length field near an edge
            off, size = fields[a % len(fields)]
            v = (EDGES[b % len(EDGES)] + (a // len(fields)) % 3 - 1) % (1 << 8 * size)
            if off + size <= n:
                blob[off:off + size] = v.to_bytes(size, "little")
        elif kind == 3:                                         # a fuzzed manifest, valid CRC
            recomputed |= _fix_manifest(blob, bytes(data))
        elif kind == 4:                                         # a structured manifest edit, valid CRC
            try:
                m = _manifest_of(blob)
            except (ValueError, struct.error, UnicodeDecodeError):
                continue
            value = Ellipsis if b % len(JSON_VALUES) == 0 and b else JSON_VALUES[b % len(JSON_VALUES)]
            try:
                _structured_edit(m, a, value)
                raw = json.dumps(m, separators=(",", ":")).encode()
            except (KeyError, IndexError, TypeError, AttributeError):
                continue
            recomputed |= _fix_manifest(blob, raw)
        elif kind == 5:                                         # a fuzzed trailer
            at = min(n, e.trailer_offset)
            blob[at:] = data
        elif kind == 6:                                         # inserted bytes
            at = a % (n + 1)
            blob[at:at] = data[:64]
        else:                                                   # deleted bytes
            at = a % (n + 1)
            del blob[at:at + 1 + b % 64]
    return bytes(blob), recomputed


# ---- atheris entry point ------------------------------------------------------------

_TARGET = None


def one_input(data):
    global _TARGET
    if _TARGET is None:
        _TARGET = Target()
    fdp = atheris.FuzzedDataProvider(data)
    shape = fdp.ConsumeIntInRange(0, 3)
    if shape == 0:
        check_header(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 60)))
    elif shape == 1:
        entry = dataclasses.replace(_TARGET.entry, tokens=fdp.ConsumeIntInRange(1, 16))
        doff = fdp.ConsumeIntInRange(24, 8192)
        check_manifest(fdp.ConsumeBytes(fdp.remaining_bytes()), entry, doff)
    elif shape == 2:
        check_trailer(fdp.ConsumeBytes(fdp.remaining_bytes()))
    else:
        ops = []
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            ops.append((fdp.ConsumeIntInRange(0, 7), fdp.ConsumeIntInRange(0, 2**20),
                        fdp.ConsumeIntInRange(0, 2**16), fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 600))))
        name = _TARGET.name if fdp.ConsumeBool() else None
        blob, recomputed = mutate(_TARGET, ops)
        check_file(_TARGET, blob, expect_original=not recomputed, name=name)


def main():
    logging.getLogger("kvstore").setLevel(logging.CRITICAL + 1)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
