"""Sharing one checkpoint: export any stored sequence as one self-contained ABI 16 file, import one.

A chain lives in blocks that other sequences share, named by digests that
only mean something next to their parents; to hand a session to someone
else it becomes one whole file (docs/format.md §14):

    kvstore.exchange.export_checkpoint(store, entry, "session.kv")
    kvstore.exchange.import_checkpoint(other_store, "session.kv")

The exported file is an ordinary ABI 16 checkpoint, named however the user
likes: its manifest keeps which tensors grow with the tokens ("axis") and
where the chain's blocks were cut ("cuts"), so an import into a chained
store cuts it into blocks again (only the blocks the store lacks are
written).  Any ABI 16 file can be imported; without cuts it becomes one
block (or one whole file in a store with layout="whole").
"""

import os
import time

from kvstore import files, names, payload, publish
from kvstore.identity import ModelIdentity
from kvstore import trailers as trailer_mod
from kvstore.errors import CorruptCheckpoint
from kvstore.format import PAYLOAD_ABI_TENSORS, PREFIX_SIZE, Header, entry_from_fd, open_checkpoint


def export_checkpoint(store, entry, path, plain=False):
    """Writes the stored sequence that ends at entry as one ABI 16 file at path.

    The file is written under a temporary name next to path and renamed into
    place (0600, synced when the store is durable); an existing file at
    path is replaced.  The export counts as a hit.

    Args:
        store: the KVStore holding entry.
        entry: an Entry (a chain's last block, or a whole file).
        path: where the file goes.
        plain: required to export from a sealed store (docs/format.md §16):
            the exported file holds the prompt text and KV state in the clear.

    Returns:
        the Entry of the new file.

    Raises:
        CorruptCheckpoint: the checkpoint does not load (vanished, corrupt,
            or not loadable by this store; the log says which).
    """
    if getattr(store, "sealed", False) and not plain:
        raise ValueError("export from a sealed store writes the checkpoint in the clear: pass plain=True")
    ckpt = store.load(entry, into="numpy", min_tokens=1, consume=False)
    if ckpt is None:
        raise CorruptCheckpoint("not_loadable", entry.path, "vanished, corrupt or not for this store (see the log)")
    e = ckpt.entry
    n = int(ckpt.tokens.size)
    # The file names its model as the store's own files do (docs/semantics.md §17).
    model = store.model_identity if e.model_tag else None
    plan = payload.Plan(len(ckpt.text_bytes), ckpt.tokens, ckpt.tensors, ckpt.meta, axes=ckpt.positional,
                        cuts={t: c for t, c in ckpt.cuts.items() if t < n}, dtypes=ckpt.dtypes, model=model)
    trailer_raw, ext = trailer_mod.encode_trailer(dict(ckpt.trailers)) if ckpt.trailers else (b"", 0)
    header = Header(quant_bits=e.quant_bits, tokens=n, ctx_size=e.ctx_size, payload_bytes=plan.payload_bytes,
                    reason=e.reason, ext_flags=ext, model_id=e.model_id, payload_abi=PAYLOAD_ABI_TENSORS,
                    created_at=e.created_at or int(time.time()), last_used=0, model_tag=e.model_tag)
    return publish.write_checkpoint(os.path.abspath(os.fspath(path)), header, ckpt.text_bytes, plan, trailer_raw,
                                    durable=store.settings.durable)


def import_checkpoint(store, path):
    """Stores the checkpoint in the ABI 16 file at path (any name) in store.

    The file is checked first as `kvstore verify` checks one (its text
    against its own digest, every CRC); its header's reason, context size
    and trailer (session title, tool-call map) come along.  A chained store
    cuts it at the file's "cuts" and writes only the blocks it lacks.

    Args:
        store: the KVStore to import into (its model id and its model
            identity must be the file's, docs/semantics.md §17).
        path: the file.

    Returns:
        the stored Entry, or None when the store refused it (budget; logged).

    Raises:
        CheckpointMissing: no such file.
        CorruptCheckpoint: the file fails a check, is not ABI 16, or was made
            by another model (id or identity) than the store's.
    """
    fd, st = open_checkpoint(path)
    try:
        e = entry_from_fd(fd, st, path)
        text = os.pread(fd, e.segment_bytes, PREFIX_SIZE)
    finally:
        os.close(fd)
    if e.payload_abi != PAYLOAD_ABI_TENSORS:
        raise CorruptCheckpoint("not_importable", path, f"payload ABI {e.payload_abi}: only whole (ABI 16) files")
    model = file_model(path)
    key = ModelIdentity(model).names if e.model_tag and model is not None else None
    why = files.verify_file(path, name=names.name_of(text, key).hex() + ".kv")
    if why is not None:
        raise CorruptCheckpoint("import_check", path, why)
    if e.model_id != store.settings.model_id:
        raise CorruptCheckpoint("not_importable", path,
                                f"made by model id {e.model_id}; the store serves model id {store.settings.model_id}")
    if (model if e.model_tag else None) != store.model_identity:
        raise CorruptCheckpoint("not_importable", path, f"made by model {model or '(none named)'}; the store "
                                f"holds model {store.model_identity or '(none named)'}")
    fd, st = open_checkpoint(path)
    try:
        e = entry_from_fd(fd, st, path)
        manifest = payload.read_manifest(fd, e)
        tokens = payload.read_tokens(fd, e, manifest)
        tensors = payload.read_tensors_numpy(fd, e, manifest)
        raw = os.pread(fd, e.file_size - e.trailer_offset, e.trailer_offset) if e.file_size > e.trailer_offset else b""
    finally:
        os.close(fd)
    values = trailer_mod.parse_trailer(raw, path)[0] if raw else {}
    return store.save(text, tokens, tensors, meta=manifest.meta, reason=e.reason, ctx_size=e.ctx_size,
                      trailers=values or None, min_tokens=1, positional=manifest.axes,
                      text_offsets=manifest.cuts or None, dtypes={t[0]: t[1] for t in manifest.tensors})


def file_model(path):
    """The model identity an ABI 16 or 17 file's manifest records, or None (none recorded, or not readable)."""
    fd, st = open_checkpoint(path)
    try:
        e = entry_from_fd(fd, st, path)
        return payload.read_manifest(fd, e).model if e.loadable else None
    except CorruptCheckpoint:
        return None
    finally:
        os.close(fd)


__all__ = ["export_checkpoint", "import_checkpoint", "file_model"]
