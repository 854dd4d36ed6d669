"""Checking a sealed file whole: every chunk authenticated, its plain copy's text, name and manifest.

What `kvstore verify` and a download run before they trust a sealed file; a
load authenticates only the chunks it reads (kvstore.seal.source).
"""

import os

from kvstore import files, names, payload
from kvstore.errors import CheckpointMissing
from kvstore.format import PREFIX_SIZE, entry_from_fd, open_checkpoint
from kvstore.seal.source import open_sealed


def verify_sealed(sealer, path, progress=None, name=None):
    """Authenticates every chunk of a sealed file and checks its plain copy:
    a whole file's text against the name, the manifest (its CRC and bounds;
    the payload's CRC fields are 0, the tags having checked every byte).  A
    block's chain is not walked: its parent's presence and link are the
    clear heads'.

    Args:
        sealer: the kvstore.seal.Sealer of the key (key_id, file_key,
            names_for).
        path: the sealed file.
        progress: called with the file's size once its chunks have
            authenticated, or None.
        name: the checkpoint name it will have, for a file not yet under
            it (a download): the tags bind the name.

    Returns:
        None when the file is sound, else a one-line reason (never prompt text).

    Raises:
        CheckpointMissing: the file vanished.
    """
    fd, st = open_checkpoint(path)
    try:
        e = entry_from_fd(fd, st, path if name is None else os.path.join(os.path.dirname(path), name))
        if not e.sealed:
            return "not_sealed: written without a key"
        if e.key_id != sealer.key_id:
            return "other_key: sealed with another key"
        src, plain = open_sealed(sealer, fd, st, e)
        # Every chunk, padding included, one scratch chunk per I/O thread.
        _wait([payload.io_pool().submit(src.authenticate, lo, hi) for lo, hi in _runs(src.chunks)])
        if progress is not None:
            progress(st.st_size)
        # The manifest parses and its blocks lie in the payload; the
        # payload's CRC fields are 0 (the tags checked every byte).
        manifest = payload.read_manifest(src, plain)
        key = sealer.names_for(plain.model_tag, manifest.model)
        if key is None:
            return "model_mismatch: the manifest names another model than the header"
        if not plain.is_block:
            return _check_name(src, plain, key)
        return None
    except CheckpointMissing:
        raise
    except Exception as err:      # noqa: BLE001 - one line per file, whatever broke
        return files.describe_error(err)
    finally:
        os.close(fd)


def _check_name(src, plain, key):
    """None when a whole file's text hashes to its name under key (a
    NameKey) and its lookup tag is the name's (or none), else the reason."""
    text = src.pread(plain.text_bytes, PREFIX_SIZE)
    (digest,), (tag,) = names.names_of(text, [len(text)], key)
    if digest.hex() != plain.sha:
        return "text_hash: stored text does not match the file name"
    if plain.lookup_tag not in (tag, bytes(len(tag))):
        return "lookup_tag: the lookup tag is not the name's (lookups pass the file over)"
    return None


def _runs(chunks):
    """Chunk ranges [lo, hi) for the I/O threads, about equal."""
    n = max(1, min(payload.IO_THREADS, chunks))
    step = -(-chunks // n)
    return [(lo, min(chunks, lo + step)) for lo in range(0, chunks, step)]


def _wait(jobs):
    """Every job's result, once all have ended (they hold views of one mapping)."""
    errors = [j.exception() for j in jobs]
    for err in errors:
        if err is not None:
            raise err
    return [j.result() for j in jobs]
