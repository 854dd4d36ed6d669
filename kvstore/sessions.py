"""Agent sessions (docs/semantics.md §9): named working states addressed by their hash.

An agent saves its live state as a checkpoint with reason agent-session and
an optional title (ext bit 3, kept in the trailer), and the checkpoint of its
system prompt with reason agent-system, so that new sessions share that prefix
through an ordinary lookup.  A session is addressed later by a prefix of its
file's SHA1, as ds4-agent's /save, /list and /switch do:

    entry = kvstore.sessions.save(store, text, tokens, tensors, title="refactor io")
    for s in kvstore.sessions.list(store):
        print(s.prefix, s.title, s.tokens)
    ckpt = kvstore.sessions.switch(store, entry.sha[:8], into="mlx")

What differs from cache checkpoints, and why:

- a session is saved and loaded at any length: min_tokens is a rule about
  which prompts are worth a lookup, and a session is asked for by name;
- switching to a session does not consume it, however long it is (docs/semantics.md §5
  deletes long cache hits because the live session takes the state over; a
  named session is something to come back to);
- a session still counts towards the disk budget and can be evicted like
  any checkpoint.

Titles are labels a person gives; prompt text is read here only for a ds4
session's title, and only when asked (from_entries(text=True)).
"""

import dataclasses
import logging
import os
import re

from kvstore import _native, ds4, identity, payload
from kvstore import trailers as trailer_mod
from kvstore.errors import AmbiguousSession, KVStoreError, SessionNotFound
from kvstore.format import ExtFlag, Reason, entry_from_fd, open_checkpoint, read_entry

__all__ = ["SessionInfo", "save", "list", "resolve", "switch", "read_title", "from_entries", "MIN_PREFIX"]

log = logging.getLogger("kvstore")

# Shortest hash prefix a switch accepts: 4 hex digits (65536 values) keep a
# typed prefix short while a stray "a" or "3f" cannot pick a session by luck;
# git uses the same floor for abbreviated hashes.
MIN_PREFIX = 4
_PREFIX_RE = re.compile(r"^[0-9a-fA-F]+$")

_TITLE_BIT = ExtFlag.SESSION_TITLE.bit_length() - 1
# Text read for a ds4 session's title: its first user turn starts near the
# front (after the system prompt); a transcript's tail is never needed.
DS4_TITLE_SCAN = 1 << 20


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """One saved agent session as `list` shows it.

    Attributes:
        sha: the full 40-hex name of the checkpoint file.
        title: the title given on save, or None.
        tokens, hits: header counts.
        created_at, last_used: unix seconds (last_used 0: never switched to).
        model_id, payload_abi, file_size: header fields, for tools.
        path: the file.
        ds4: ds4-agent saved it (kvstore.ds4): listed, not loadable here.
    """
    sha: str
    title: object
    tokens: int
    hits: int
    created_at: int
    last_used: int
    model_id: int
    payload_abi: int
    file_size: int
    path: str
    ds4: bool = False

    @property
    def prefix(self):
        """The 12-hex prefix that names the session in listings."""
        return self.sha[:12]


def read_title(entry, sealer=None):
    """The session title in a checkpoint's trailer, or None.

    Reads only the trailer's section headers and the title body (at most
    trailers.TITLE_MAX_BYTES); applies parse_trailer's rules: the first
    section for ext bit 3 whose CRC and UTF-8 check out wins.  A sealed
    file's trailer is read through its key (decrypting and authenticating
    only the chunks the reads cover).

    Args:
        entry: an Entry (its ext flags say whether a title is there).
        sealer: the kvstore.seal.Sealer of a sealed file's key (KVStore.sealer),
            or None: sealed files then show no title.

    Returns:
        str, or None when there is no title or it cannot be read.
    """
    if not entry.ext_flags & ExtFlag.SESSION_TITLE:
        return None
    try:
        fd, st = open_checkpoint(entry.path)
    except KVStoreError:
        return None
    try:
        cur = entry_from_fd(fd, st, entry.path)     # the file may have changed since listing
        if not cur.ext_flags & ExtFlag.SESSION_TITLE:
            return None
        src = fd
        if cur.sealed:
            if sealer is None or not sealer.owns(cur):
                return None
            src, cur = sealer.source(fd, st, cur)
        hook = trailer_mod.hooks()[_TITLE_BIT]
        for bit, offset, length, crc in trailer_mod.trailer_sections(src, cur):
            if bit != _TITLE_BIT or length > trailer_mod.TITLE_MAX_BYTES:
                continue
            body = payload.pread(src, length, offset)
            if len(body) != length or _native.crc32c(body) != crc:
                continue
            try:
                return hook.decode(body)
            except ValueError:
                continue
        return None
    except (KVStoreError, OSError):
        return None
    finally:
        os.close(fd)


def save(store, text, tokens, tensors, meta=None, title=None, system_text=None,
         system_tokens=None, system_tensors=None, system_meta=None, positional=None, text_offsets=None,
         system_text_offsets=None):
    """Saves the live state as an agent session (and its system prompt's checkpoint).

    Args:
        store: a KVStore.
        text, tokens, tensors, meta: the session's checkpoint, as KVStore.save.
        title: a label for `list` (str, at most 4 KiB of UTF-8), or None to
            keep the title a previous save of the same text gave.
        system_text, system_tokens, system_tensors, system_meta: the system
            prompt's checkpoint, stored with reason agent-system under the
            store's usual rules (it is found by lookup, so min_tokens holds).
            The first three go together.
        positional, text_offsets, system_text_offsets: as KVStore.save (a
            chained store then writes only the blocks it lacks; positional
            applies to both states).

    Returns:
        the session's Entry, or None when the store refused it (over budget,
        no tokens) or the disk failed; the log says why.

    Raises:
        ValueError / TypeError: a bad title, or system_* given in part.
    """
    parts = (system_text, system_tokens, system_tensors)
    if any(p is not None for p in parts) and not all(p is not None for p in parts):
        raise ValueError("system_text, system_tokens and system_tensors must be given together")
    trailers = None
    if title is not None:
        trailer_mod.hooks()[_TITLE_BIT].encode(title)   # a bad title fails before anything is written
        trailers = {ExtFlag.SESSION_TITLE: title}
    if system_text is not None:
        if store.save(system_text, system_tokens, system_tensors, meta=system_meta,
                      reason=Reason.AGENT_SYSTEM, positional=positional,
                      text_offsets=system_text_offsets) is None:
            # The session is still worth saving; the store logged the refusal.
            log.info("kvstore: session_system_not_saved")
    return store.save(text, tokens, tensors, meta=meta, reason=Reason.AGENT_SESSION,
                      trailers=trailers, min_tokens=1, positional=positional, text_offsets=text_offsets)


def list(store):   # noqa: A001 - the verb of docs/semantics.md §9; the builtin is not used here
    """Every agent session in the store's directory, newest first.

    Args:
        store: a KVStore.

    Returns:
        list of SessionInfo, by creation time, newest first.
    """
    return from_entries(store.entries(), store.sealer)


def from_entries(entries, sealer=None, text=False):
    """The agent sessions among entries (headers re-read from disk), newest first.

    For a caller that lists a directory itself (`kvstore session list`
    reads it without opening a store).  ds4-agent's sessions are listed too
    (SessionInfo.ds4); theirs have no title but the one ds4 derives from the
    first user turn (kvstore.ds4.session_title), which is prompt text: read
    only with text=True.

    Args:
        entries: Entry objects (kvstore.files.scan_directory, KVStore.entries).
        sealer: the key of sealed sessions' titles (see read_title), or None.
        text: give ds4 sessions the title ds4-agent's /list shows.

    Returns:
        list of SessionInfo, by creation time, newest first.
    """
    out = [SessionInfo(sha=e.sha, title=_title(e, sealer, text), tokens=e.tokens, hits=e.hits,
                       created_at=e.created_at, last_used=e.last_used, model_id=e.model_id,
                       payload_abi=e.payload_abi, file_size=e.file_size, path=e.path, ds4=ds4.is_ds4(e))
           for e in _fresh(entries)
           if e.reason == Reason.AGENT_SESSION and e.sha and (e.restorable or ds4.is_ds4(e))]
    out.sort(key=lambda s: (s.created_at, s.last_used, s.sha), reverse=True)
    return out


def _title(e, sealer, text):
    if not ds4.is_ds4(e):
        return read_title(e, sealer)
    if not text:
        return None
    try:
        fd, _ = open_checkpoint(e.path)
    except KVStoreError:
        return None
    try:
        return ds4.session_title(payload.pread(fd, min(e.text_bytes, DS4_TITLE_SCAN), e.text_offset))
    except OSError:
        return None
    finally:
        os.close(fd)


def _fresh(entries):
    """The entries' headers as they are on disk now.

    A store's index re-reads a header only when the directory changes, but
    hits, last-used time and the reason (a re-save promotes a checkpoint to
    a session) change in place, from any process.
    """
    out = []
    for e in entries:
        try:
            out.append(read_entry(e.path))
        except KVStoreError:
            continue              # gone or broken since the listing
    return out


def _check_prefix(sha_prefix):
    if not isinstance(sha_prefix, str):
        raise TypeError(f"session prefix must be a str, not {type(sha_prefix).__name__}")
    if not (MIN_PREFIX <= len(sha_prefix) <= 40 and _PREFIX_RE.match(sha_prefix)):
        raise ValueError(f"session prefix {sha_prefix!r} must be {MIN_PREFIX} to 40 hex digits")
    return sha_prefix.lower()


def resolve(store, sha_prefix):
    """The agent session whose hash starts with sha_prefix.

    Args:
        store: a KVStore (or anything with entries()).
        sha_prefix: at least MIN_PREFIX hex digits (any case).

    Returns:
        the session's Entry.

    Raises:
        ValueError: the prefix is not 4 to 40 hex digits.
        SessionNotFound: no agent session starts with it.
        AmbiguousSession: more than one does (the error lists them).
    """
    p = _check_prefix(sha_prefix)
    found = [e for e in _fresh(e for e in store.entries() if e.sha.startswith(p))
             if e.reason == Reason.AGENT_SESSION]
    if not found:
        raise SessionNotFound(f"no agent session starts with {p!r}")
    if len(found) > 1:
        shas = sorted(e.sha for e in found)
        raise AmbiguousSession(f"session prefix {p!r} is ambiguous: it matches "
                               + ", ".join(s[:12] for s in shas) + "; give more digits", shas)
    return found[0]


def _why_not(store, e):
    """Why store.load refused a session (for the error message only)."""
    why = store.misfit(e)
    if why == "payload_abi" and ds4.is_ds4(e):
        return "ds4 wrote it (payload ABI 0 or 2: ds4's graph state): switch to it in ds4-agent"
    if why == "payload_abi":
        return f"its payload ABI {e.payload_abi} is not one this build loads"
    if why == "model":
        return (f"it was saved by another model (tag {identity.tag_hex(e.model_tag)}), this store holds model "
                f"{store.model_identity or '(none named)'}")
    if why == "model_id":
        return f"it was saved by model id {e.model_id}, this store serves model id {store.settings.model_id}"
    if why == "ctx_size":
        return f"it was made with context {e.ctx_size}, larger than this store's {store.settings.ctx_size}"
    if why == "quant_bits":
        return f"it was made with {e.quant_bits}-bit weights, this store rejects other quants"
    return "it vanished or was corrupt (see the log)"


def switch(store, sha_prefix, into="numpy"):
    """Loads an agent session by a unique prefix of its hash.

    The session is not consumed and loads whatever its length; the load
    counts as a hit (hits + 1, last used = now).

    Args:
        store: a KVStore.
        sha_prefix: at least MIN_PREFIX hex digits.
        into: "numpy" or "mlx".

    Returns:
        kvstore.Checkpoint.

    Raises:
        ValueError: a malformed prefix or into.
        SessionNotFound: no such session, or this store cannot load it (the
            message says why: another model, payload ABI, context or quant).
        AmbiguousSession: the prefix matches more than one session.
    """
    e = resolve(store, sha_prefix)
    ckpt = store.load(e, into=into, min_tokens=1, consume=False)
    if ckpt is None:
        raise SessionNotFound(f"session {e.sha[:12]} cannot be loaded: {_why_not(store, e)}")
    return ckpt
