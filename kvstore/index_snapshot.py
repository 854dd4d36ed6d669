"""The index snapshot: a directory's index kept in the directory, so that a store opens without reading every file.

``<dir>/.index`` (0600, docs/semantics.md §4) holds the envelope fields of
every checkpoint the index held when it was written (what
kvstore.format.read_entry gives, less the path), with the file's inode,
mtime and size; the directory it was made in (device and inode), the
machine's boot time, the directory mtime the index accounted for and the
journal position it had read up to (kvstore.journal).  It holds no text:
only names, sizes, times, header fields, chain links, token digests and
a sealed file's key id and lookup tag, which every .kv file carries in
clear in its first bytes.

The files stay the truth.  kvstore.index takes a snapshot as a starting
point and checks it against the directory: a snapshot that is damaged
(its CRC32C), of another layout version, made in another directory
(copied over) or before the machine last booted (a power loss may have
cut files it lists) is not used; the names listed now and the journal's
records since the snapshot's position say what changed, and a directory
mtime that the journal cannot explain makes the index stat every file
(reading only the envelopes that changed).  The snapshot is written to a
temporary file, synced and renamed into place, so a crash leaves the old
snapshot or the new one, and each said what it knew then.

Layout (little-endian): a 68-byte head, ``count`` records of
RECORD.itemsize (192) bytes, then a CRC32C of everything before it (u32).
"""

import collections
import dataclasses
import operator
import os
import re
import secrets
import stat
import struct
from itertools import repeat

import numpy as np
from numpy.lib import recfunctions

from kvstore import _native, temps
from kvstore.format import BLOCK_ABIS as _BLOCK_ABIS
from kvstore.format import TOKEN_DIGEST, Entry, ExtFlag, Reason

SNAPSHOT_NAME = ".index"
MAGIC = b"KVIX"
VERSION = 1

# magic, version, directory device, directory inode, boot time (unix s),
# the directory mtime the index accounted for (ns), journal inode, journal
# offset (0, 0: no journal position), record count, record size, 4 zero bytes.
HEAD = struct.Struct("<4sIQQqqQQIII")
HEAD_SIZE = HEAD.size                       # 68
CRC = struct.Struct("<I")

# Bytes of the key id and the lookup tag of a sealed file (SEAL_HEAD's 8s).
SEAL_ID = 8

# kind bits: the record's chain fields are the entry's (a block), its seal
# fields are (a sealed file); otherwise those fields are the Entry defaults.
KIND_CHAIN = 1
KIND_SEALED = 2

RECORD = np.dtype([
    ("name", "S40"),                         # the name's hex digits, as on disk (any case)
    ("inode", "<u8"), ("mtime_ns", "<i8"), ("file_size", "<u8"),
    ("created_at", "<u8"), ("last_used", "<u8"), ("payload_bytes", "<u8"), ("text_bytes", "<u8"),
    ("token_start", "<u8"), ("text_start", "<u8"),
    ("tokens", "<u4"), ("hits", "<u4"), ("ctx_size", "<u4"), ("block_grid", "<u4"), ("model_tag", "<u4"),
    ("chain_flags", "<u2"),
    ("quant_bits", "u1"), ("reason", "u1"), ("ext_flags", "u1"), ("model_id", "u1"), ("payload_abi", "u1"),
    ("kind", "u1"),
    ("parent", "V20"), ("token_digest", f"V{TOKEN_DIGEST}"), ("parent_token_digest", f"V{TOKEN_DIGEST}"),
    ("key_id", f"V{SEAL_ID}"), ("lookup_tag", f"V{SEAL_ID}"),
    ("parent_row", "<u4"),                   # the parent's record (count: none among them)
])

# The integer fields, written and read as columns.
INT_FIELDS = ("inode", "mtime_ns", "file_size", "created_at", "last_used", "payload_bytes", "text_bytes",
              "token_start", "text_start", "tokens", "hits", "ctx_size", "block_grid", "model_tag", "chain_flags",
              "quant_bits", "model_id", "payload_abi")
_INTS = INT_FIELDS + ("reason", "ext_flags")
# The block ABIs as np.isin takes them (a list-like, not a set).
BLOCK_ABIS = tuple(sorted(_BLOCK_ABIS))
_INTS_OF = operator.attrgetter(*_INTS)
_BYTES_OF = operator.attrgetter("parent", "token_digest", "parent_token_digest", "key_id", "lookup_tag")

# Every field of an Entry that a snapshot holds; an Entry with another that
# an envelope gives (one its equality compares: not a lookup's own state)
# makes snapshots unusable until the layout holds it.
HELD_FIELDS = frozenset(_INTS) | {"sha", "path", "parent", "token_digest", "parent_token_digest", "key_id",
                                  "lookup_tag"}
USABLE = {f.name for f in dataclasses.fields(Entry) if f.compare} <= HELD_FIELDS

# A temporary snapshot is ".index.tmp.<pid>.<random>": kvstore.temps judges
# it as it judges a checkpoint's temporary (tracked while written here).

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_REASONS = sorted(Reason)
_writing = set()            # the temporary snapshots this process is writing now


@dataclasses.dataclass
class Snapshot:
    """A snapshot as read: the file names, their Entry objects and digests
    (sha) in the order written, the digests as an (n, 20) uint8 array, each
    entry's parent's row (n: none among them), the records (RECORD), the
    directory mtime the index accounted for, the journal position (inode,
    offset) or None, and whether no two names spell one digest."""
    names: list
    entries: list
    shas: list
    digests: np.ndarray
    parent_rows: np.ndarray
    records: np.ndarray
    mtime_ns: int
    journal: tuple
    unique: bool


def _boot_s():
    boot = temps.boot_time()
    return int(boot) if boot else 0


# ---- writing ---------------------------------------------------------------------

def records_of(names, entries, base=None):
    """The RECORD array of entries (Entry) called names, or None when one
    does not fit the layout (a value wider than its record field).

    Args:
        names, entries: the file names and their entries, in the order to keep.
        base: (records, entries) of an earlier snapshot: an entry that is one
            of those objects keeps its record (nothing of it changed since).
    """
    n = len(entries)
    if not USABLE:
        return None
    if base is not None:
        row = dict(zip(map(id, base[1]), range(len(base[1]))))
        at = np.fromiter(map(row.get, map(id, entries), repeat(-1)), dtype=np.int64, count=n)
        fresh = np.flatnonzero(at < 0).tolist()
        new = records_of([names[i] for i in fresh], [entries[i] for i in fresh]) if fresh else None
        if fresh and new is None:
            return None
        rec = np.empty(n, dtype=RECORD)
        rec[at >= 0] = base[0][at[at >= 0]]
        if fresh:
            rec[fresh] = new
        return _with_parent_rows(rec)
    rec = np.zeros(n, dtype=RECORD)
    try:
        ints = np.array(list(map(_INTS_OF, entries)), dtype=np.int64).reshape(n, len(_INTS))
        for k, f in enumerate(_INTS):
            limits = np.iinfo(RECORD[f])
            if n and (ints[:, k].min() < limits.min or ints[:, k].max() > limits.max):
                return None
            rec[f] = ints[:, k]
        joined = "".join(names).encode("ascii")
    except (OverflowError, UnicodeError):
        return None
    if len(joined) != 43 * n or not _bytes_fields(rec, entries):
        return None
    rec["name"] = np.frombuffer(joined, np.uint8).reshape(n, 43)[:, :40].copy().view("S40").reshape(n)
    return _with_parent_rows(rec)


def _with_parent_rows(rec):
    """rec with each record's parent_row set (None when a name is not hex)."""
    digests = digests_of(rec)
    if digests is None:
        return None
    rec["parent_row"] = linked_rows(digests, np.frombuffer(rec["parent"].tobytes(), np.uint8).reshape(len(rec), 20))
    return rec


def _bytes_fields(rec, entries):
    """Fills rec's kind, parent, token digests, key id and lookup tag from
    entries; False when one is not as the layout holds it."""
    n = len(entries)
    parent, *raws = zip(*map(_BYTES_OF, entries)) if n else [()] * 5
    chain = np.isin(rec["payload_abi"], BLOCK_ABIS)
    sealed = np.fromiter(map(bool, raws[2]), dtype=bool, count=n)
    rec["kind"] = np.where(chain, KIND_CHAIN, 0) | np.where(sealed, KIND_SEALED, 0)
    spelled = _packed(parent, 40, chain, optional=True)
    packed = [_packed(raw, width, present)
              for raw, width, present in zip(raws, (TOKEN_DIGEST, TOKEN_DIGEST, SEAL_ID, SEAL_ID),
                                             (chain, chain, sealed, sealed))]
    if spelled is None or None in packed:
        return False
    try:
        rec["parent"] = np.frombuffer(bytes.fromhex(spelled.decode("ascii")), "V20")
    except (UnicodeError, ValueError):
        return False
    for f, raw in zip(("token_digest", "parent_token_digest", "key_id", "lookup_tag"), packed):
        rec[f] = np.frombuffer(raw, rec.dtype[f])
    return True


def encode(rec, dir_stat, mtime_ns, journal):
    """The bytes of a snapshot of the records rec (RECORD).

    Args:
        dir_stat: os.stat of the directory (its identity).
        mtime_ns: the directory mtime the index accounts for.
        journal: (journal inode, offset read up to), or None.
    """
    j_ino, j_off = journal or (0, 0)
    head = HEAD.pack(MAGIC, VERSION, dir_stat.st_dev, dir_stat.st_ino, _boot_s(), mtime_ns, j_ino, j_off, len(rec),
                     RECORD.itemsize, 0)
    body = head + rec.tobytes()
    return body + CRC.pack(_native.crc32c(body))


def _packed(values, width, present, optional=False):
    """values (bytes, or str for a parent's hex) joined at width each, zeros
    where absent (bytes 0 for a str); None when one is neither width long
    where present (or empty, when optional) nor empty elsewhere."""
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    fits = (lengths == width) | ((lengths == 0) & (optional | ~present))
    if not (fits & (present | (lengths == 0))).all():
        return None
    if (lengths == width).all():
        joined = "".join(values) if values and isinstance(values[0], str) else b"".join(values)
    else:
        blank = "0" * width if values and isinstance(values[0], str) else bytes(width)
        joined = type(blank)().join(v or blank for v in values)
    return joined.encode("ascii") if isinstance(joined, str) else joined


def write(directory, data):
    """Replaces the directory's snapshot with data: a temporary file (0600),
    renamed into place.  Returns True when it is in place.

    Not synced: the snapshot is a cache of what the files say.  A power
    loss may leave the old snapshot or a damaged new one (its CRC fails and
    the next open lists the directory); either is reconciled with the
    listing of names and the journal, so it never hides a stored file nor
    offers a deleted one, and saving an fsync keeps close() cheap."""
    tmp = os.path.join(directory, f"{SNAPSHOT_NAME}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    temps.track(tmp)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, SNAPSHOT_NAME))
        return True
    except OSError:
        _unlink(tmp)
        return False
    finally:
        temps.untrack(tmp)


def remove(directory):
    """Removes the directory's snapshot; True when there was one."""
    return _unlink(os.path.join(directory, SNAPSHOT_NAME))


def _unlink(path):
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


# ---- reading ---------------------------------------------------------------------

def read(directory, dir_stat):
    """The directory's snapshot, or None when there is none that may be used:
    missing, unreadable, cut short or damaged (size, CRC32C), another layout
    version, made in another directory or before the machine last booted."""
    path = os.path.join(directory, SNAPSHOT_NAME)
    if not USABLE:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK)      # (a FIFO does not block)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode) or size < HEAD_SIZE + CRC.size:
            return None
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            step = os.readv(fd, [view[got:]])
            if step == 0:
                return None           # cut short while it was read: not this snapshot
            got += step
    except OSError:
        return None
    finally:
        os.close(fd)
    (magic, version, dev, ino, boot, mtime_ns, j_ino, j_off, count, rec_size, _) = HEAD.unpack_from(data)
    if (magic != MAGIC or version != VERSION or rec_size != RECORD.itemsize
            or size != HEAD_SIZE + count * rec_size + CRC.size):
        return None
    if _native.crc32c(memoryview(data)[:size - CRC.size]) != CRC.unpack_from(data, size - CRC.size)[0]:
        return None
    if (dev, ino) != (dir_stat.st_dev, dir_stat.st_ino) or boot == 0 or boot != _boot_s():
        return None
    rec = np.frombuffer(data, dtype=RECORD, count=count, offset=HEAD_SIZE)
    digests = digests_of(rec)
    if digests is None or (count and int(rec["reason"].max()) >= len(_REASONS)):
        return None                   # not what an envelope gives: damaged, though its CRC matched
    parents = np.frombuffer(rec["parent"].tobytes(), np.uint8).reshape(count, 20)
    prow = rec["parent_row"].astype(np.int64)
    linked = prow < count
    if (prow > count).any() or not (digests[prow[linked]] == parents[linked]).all():
        prow = linked_rows(digests, parents)          # not as written: found again
    fields = fields_of(directory, rec, prow, parents)
    # Names are unique in a directory: two spell one digest only in two cases of hex.
    unique = fields.pop("lowercase") or len(set(fields["sha"])) == count
    entries = make_entries(fields, count)
    return Snapshot(fields["name"], entries, fields["sha"], digests, prow, rec, mtime_ns,
                    (j_ino, j_off) if j_ino else None, unique)


_FORTY = re.compile(".{40}", re.S)


def digests_of(rec):
    """The 20-byte digests the records' names spell, as an (n, 20) uint8
    array, or None when a name is not 40 hex digits."""
    try:
        raw = bytes.fromhex(rec["name"].tobytes().decode("ascii"))
    except (UnicodeError, ValueError):
        return None
    if len(raw) != 20 * len(rec):
        return None                     # (fromhex passes over whitespace)
    return np.frombuffer(raw, np.uint8).reshape(len(rec), 20)


def fields_of(directory, rec, prow, parents):
    """The Entry fields of the records (for make_entries), "name": the file
    names, and "lowercase": whether all of them are in lowercase hex.

    Args:
        prow: each record's parent's row (n: none among them).
        parents: the parents' digests, (n, 20) uint8.
    """
    n = len(rec)
    spelled = rec["name"].tobytes().decode("ascii")
    own, lower = _FORTY.findall(spelled), spelled.lower()
    lowercase = lower == spelled
    shas = own if lowercase else _FORTY.findall(lower)
    names = list(map(str.__add__, own, repeat(".kv")))
    fields = {"name": names, "lowercase": lowercase, "sha": shas,
              "path": list(map(os.path.join(directory, "").__add__, names))}
    for f in INT_FIELDS:
        fields[f] = _column(rec[f])
    fields["reason"] = _column(rec["reason"], _REASONS.__getitem__)
    fields["ext_flags"] = _column(rec["ext_flags"], ExtFlag)
    kind = rec["kind"]
    for f, bit in (("token_digest", KIND_CHAIN), ("parent_token_digest", KIND_CHAIN), ("key_id", KIND_SEALED),
                   ("lookup_tag", KIND_SEALED)):
        fields[f] = _column(rec[f], absent=(kind & bit) == 0, blank=b"")
    # A parent among the records is named by its own digest string; one that
    # is not (an orphan's) is spelled out.
    fields["parent"] = list(map([*shas, ""].__getitem__, prow.tolist()))
    for i in np.flatnonzero((prow == n) & parents.any(axis=1) & ((kind & KIND_CHAIN) != 0)).tolist():
        fields["parent"][i] = parents[i].tobytes().hex()
    for i in np.flatnonzero((prow < n) & ((kind & KIND_CHAIN) == 0)).tolist():
        fields["parent"][i] = ""
    return fields


def linked_rows(digests, parents):
    """The row of each entry's parent (n where it is not among them).

    Args:
        digests, parents: (n, 20) uint8 arrays: each entry's digest, its
            parent's (zeros: none).
    """
    n = len(digests)
    keys = np.ascontiguousarray(digests[:, :8]).view("<u8").reshape(n)
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    if n > 1 and (ranked[1:] == ranked[:-1]).any():
        # Two digests share their first 8 bytes: a dictionary of them all.
        row = {digests[i].tobytes(): i for i in range(n)}
        return np.array([row.get(p.tobytes(), n) for p in parents], dtype=np.int64).reshape(n)
    at = np.minimum(np.searchsorted(ranked, np.ascontiguousarray(parents[:, :8]).view("<u8").reshape(n)),
                    max(n - 1, 0))
    rows = order[at] if n else np.zeros(0, dtype=np.int64)
    found = (digests[rows] == parents).all(axis=1) & parents.any(axis=1)
    return np.where(found, rows, n).astype(np.int64)


def _column(values, convert=None, absent=None, blank=None):
    """A column of an Entry field: a list of n values, or a tuple of ONE
    value when every record holds the same.  values: an int array, or a
    void one (bytes values, compared as integers of their width);
    convert: applied to each int value; absent: rows whose field is blank
    (the Entry default) instead."""
    n = len(values)
    if absent is not None and absent.any():
        if absent.all():
            return (blank,)
        out = _column(values, convert)
        out = list(out) * n if isinstance(out, tuple) else out
        for i in np.flatnonzero(absent).tolist():
            out[i] = blank
        return out
    same = values.view(f"<u{values.dtype.itemsize}") if values.dtype.kind == "V" else values
    if n and (same == same[0]).all():
        values = values[:1]
    vals = values.tolist()
    if convert is not None:
        vals = list(map(convert, vals))
    return tuple(vals) if len(vals) == 1 and n > 1 else vals


def groups(rec, fields):
    """(the first row of each distinct combination of rec's fields, each
    row's group as an index into those firsts)."""
    keys = recfunctions.repack_fields(rec[list(fields)])
    _, first, inverse = np.unique(keys.view(f"V{keys.dtype.itemsize}"), return_index=True, return_inverse=True)
    return first.tolist(), inverse.reshape(-1)


def make_entries(fields, n):
    """n Entry objects from fields: field -> a list of n values, or a tuple
    of one value that every entry has ("name", not a field, is left out).

    An Entry is a frozen dataclass: its own __init__ sets each field through
    object.__setattr__, which for 100,000 entries costs more than the rest of
    an open.  Each instance dictionary here is a copy of one that holds the
    values every entry shares (a copy that keeps sharing its keys with
    every other Entry's, so an entry takes no more memory than one made by
    __init__), updated with the entry's own values in one call: what pickle
    does for such objects.  Fields left out keep their dataclass defaults.
    """
    fields = {f: v for f, v in fields.items() if f not in ("name", "lowercase")}
    own = [f for f, v in fields.items() if not isinstance(v, tuple)]
    if "__slots__" in vars(Entry):
        return [Entry(**{f: v[0] for f, v in fields.items() if isinstance(v, tuple)}, **dict(zip(own, row)))
                for row in zip(*(fields[f] for f in own))]
    shared = vars(object.__new__(Entry))
    shared.update((f, v[0] if isinstance(v, tuple) else None) for f, v in fields.items())
    dicts = list(map(dict.copy, repeat(shared, n)))
    collections.deque(map(dict.update, dicts, map(zip, repeat(own), zip(*(fields[f] for f in own)))), 0)
    objs = list(map(object.__new__, repeat(Entry, n)))
    collections.deque(map(object.__setattr__, objs, repeat("__dict__"), dicts), 0)
    return objs
