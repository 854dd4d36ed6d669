"""One open store directory: what every part of a store works on (docs/semantics.md §4-§9, §11; docs/format.md §10).

A Directory holds a store's settings, its lookup index, the in-process
lock, the directory's shared counters and the store's codec, and the few
acts every part needs: judging whether an entry fits this engine, counting,
taking the directory's advisory lock, and removing a file only while it is
still the file that was judged.  The reader, the saver and the evictor each
take a Directory; none of them knows the others, nor the KVStore that wires
them.
"""

import errno
import fcntl
import logging
import os
import stat as stat_mod
import threading
import time

from kvstore import counters, files, policy, registry, temps
from kvstore import pins as pins_mod
from kvstore.errors import CheckpointOSError, UnsafePath, os_error
from kvstore.files import short_name
from kvstore.forest import TieredLookup
from kvstore.index import DirectoryIndex
from kvstore.settings import DEFAULT_SETTINGS

log = logging.getLogger("kvstore")

LOCK_NAME = ".kvstore.lock"

# The directory counters (kvstore.counters) that KVStore.stats() knows by
# another name; the others have the same name in both.
STAT_KEYS = {"bytes_written": "bytes_saved", "bytes_read": "bytes_loaded", "save_seconds": "save_s",
             "load_seconds": "load_s"}
_COUNTED = frozenset(counters.COUNTER_NAMES) | frozenset(counters.HISTOGRAMS)


class Directory:
    """An open store directory (see the module docstring).

    Args:
        path: the directory; created 0700 if missing.
        codec: the store's kvstore.codec.Codec.
        identity: the store's kvstore.identity.ModelIdentity, or None.
        settings: the store's kvstore.Settings (checked when it was made).
    """

    def __init__(self, path, codec, identity=None, settings=DEFAULT_SETTINGS):
        self.path = os.path.abspath(os.fspath(path))
        self.codec = codec
        self.identity = identity
        self.settings = settings
        self.accept_unidentified = settings.accept_unidentified and identity is not None
        self.write_budget_bytes = counters.budget_capacity(settings.max_write_mb_per_hour)
        self.lock = threading.RLock()
        self.stats = dict(hits=0, misses=0, loads=0, bytes_loaded=0, load_s=0.0, saves=0,
                          bytes_saved=0, save_s=0.0, refused=0, save_errors=0, evictions=0,
                          bytes_evicted=0, corrupt=0, consumed=0, stores_skipped_write_budget=0,
                          canary_checks=0, canary_failures=0, chains_over_half_budget=0,
                          kv_raw_bytes=0, kv_stored_bytes=0)
        self._make()
        self.budget_bytes, self.budget_derived = budget_bytes_for(self.path, settings.budget_mb)
        log.info("kvstore: store_budget bytes=%d derived_from_filesystem=%s", self.budget_bytes,
                 "yes" if self.budget_derived else "no")
        # The directory's own counters, shared with every process using it.
        self.counters = counters.DirectoryCounters(self.path)
        if self.write_budget_bytes is not None:
            # Records this process's capacity (and clamps the level to it).
            self.counters.take(0, self.write_budget_bytes, lambda available: True)
        self.index = DirectoryIndex(self.path, lambda e: self.misfit(e) is None, settings.min_tokens,
                                    codec.lookup_keys())
        self.lookup = TieredLookup(self.index)

    def sweep_temps(self):
        """Removes the stale temporary files the index's last listing saw
        (kvstore.temps): after the first refresh, so that opening a store
        lists the directory once."""
        with self.lock:
            names = list(self.index.temp_names)
        for name in temps.remove_stale_temps(self.path, names=names):
            log.info("kvstore: stale_tmp_removed file=%s", short_name(name))

    def _make(self):
        """Creates the directory (0700) or checks the one there; names its model."""
        try:
            files.make_dir(self.path, self.settings.durable)
            os.chmod(self.path, 0o700)      # whatever the umask
        except FileExistsError:
            st = os.lstat(self.path)
            if stat_mod.S_ISLNK(st.st_mode) or not stat_mod.S_ISDIR(st.st_mode):
                raise UnsafePath(errno.ENOTDIR, "store path is not a directory", self.path) from None
        except OSError as e:
            raise CheckpointOSError(e.errno, f"cannot create store directory: {e.strerror}", self.path) from None
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            raise CheckpointOSError(errno.EACCES, "store directory is not readable and writable", self.path)
        if self.identity is not None:
            # Names the model in kvstore ls and stats (docs/semantics.md §17).
            with self.dir_lock(fcntl.LOCK_EX):
                registry.record(self.path, self.identity, self.settings.durable)

    # -- what fits ------------------------------------------------------------

    @property
    def model_identity(self):
        """The identity string of the store's model, or None (kvstore.identity)."""
        return None if self.identity is None else self.identity.fingerprint

    @property
    def model_tag(self):
        """The header model tag of the store's files (0: they name no model)."""
        return 0 if self.identity is None else self.identity.tag

    def misfit(self, entry, ctx_size=None):
        """Why this store cannot load entry, or None when it fits (kvstore.policy.misfit)."""
        s = self.settings
        ctx = s.ctx_size if ctx_size is None else ctx_size
        return policy.misfit(entry, s.model_id, ctx, s.quant_bits, s.reject_different_quant,
                             self.codec.abis, self.codec.key_id, self.model_tag, self.accept_unidentified)

    def eligible(self, e, min_tokens=None):
        """e fits and is at least min_tokens long (default settings.min_tokens)."""
        if min_tokens is None:
            min_tokens = self.settings.min_tokens
        return e.tokens >= min_tokens and self.misfit(e) is None

    # -- counting and locking -------------------------------------------------

    def count(self, **deltas):
        """Adds to this process's stats and to the directory's counters.

        The one place both change, so they never disagree.  Names are the
        directory's (kvstore.counters: saves, bytes_written, loads,
        bytes_read, hits, misses, evictions, bytes_evicted, corrupt,
        stores_skipped_write_budget, and the save_seconds and load_seconds
        histograms, given in seconds); stats keeps bytes_written,
        bytes_read and the seconds under its older names (STAT_KEYS).
        Names the directory does not count (refused, save_errors, consumed)
        stay in this process.
        """
        with self.lock:
            for k, v in deltas.items():
                self.stats[STAT_KEYS.get(k, k)] += v
        # The file's lock is never taken under the store's.
        shared = {k: v for k, v in deltas.items() if k in _COUNTED}
        if shared:
            self.counters.add(**shared)

    def dir_lock(self, mode):
        """The directory's advisory lock: shared while blocks are published,
        exclusive while evicting (docs/semantics.md §11)."""
        return DirLock(os.path.join(self.path, LOCK_NAME), mode)

    # -- removing files -------------------------------------------------------

    def miss(self, entry):
        """Counts a miss for entry (dropped from the index when its file is gone); None."""
        with self.lock:
            if not os.path.lexists(entry.path):
                self.index.discard(entry.name)
        self.count(misses=1)
        return None

    def unlink_if_same(self, path, st):
        """Unlinks path only if it is still the file we opened (not a newer save)."""
        if not files.unlink_if_same(path, st):
            return False
        with self.lock:
            self.index.discard(os.path.basename(path))
        return True

    def unlink_entry(self, e):
        """Unlinks the file of e if it is still that file (same inode); True when it did."""
        st = still_there(e)
        return st is not None and self.unlink_if_same(e.path, st)

    def discard(self, entry, reason, quarantine=None):
        """Removes (or quarantines) entry's file if it is still that file; a
        chain block takes the blocks after it along (KVStore.discard)."""
        st = still_there(entry)
        if st is None:
            return False
        if entry.is_block:
            self.discard_block(entry, reason, quarantine)
        else:
            self.discard_corrupt(entry.path, st, reason, quarantine)
        return not os.path.lexists(entry.path)

    def delete(self, e, why):
        """Removes e's file as an eviction (counted and logged); True when it went."""
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            return False
        with self.lock:
            self.index.discard(e.name)
        self.count(evictions=1, bytes_evicted=e.file_size)
        log.info("kvstore: evicted reason=%s tokens=%d bytes=%d file=%s", why, e.tokens, e.file_size,
                 short_name(e.name))
        return True

    def discard_corrupt(self, path, st, reason, quarantine=None):
        """Removes (or moves aside) a corrupt file, if it is still the file st describes."""
        name = os.path.basename(path)
        self.count(corrupt=1)
        if self.settings.quarantine if quarantine is None else quarantine:
            try:
                files.quarantine(path, self.path)
                with self.lock:
                    self.index.discard(name)
                action = "quarantined"
            except OSError:
                action = "kept"
        else:
            action = "removed" if self.unlink_if_same(path, st) else "kept"
        log.warning("kvstore: corrupt reason=%s action=%s file=%s", reason, action, short_name(name))

    def discard_block(self, entry, reason, quarantine=None):
        """A bad block goes (removed or quarantined) with the blocks after it in its chains."""
        with self.lock:
            after = self.index.descendants(entry)
        st = still_there(entry)
        if st is not None:
            self.discard_corrupt(entry.path, st, reason, quarantine)
        for e in after:
            if self.unlink_entry(e):
                log.info("kvstore: block_removed reason=parent_corrupt file=%s", short_name(e.name))

    def discard_torn(self):
        """Removes (or quarantines) the files whose envelope is torn (a power
        loss's debris, kvstore.index.TORN_REASONS); under the exclusive lock."""
        with self.lock:
            torn = self.index.torn
        for name, reason in torn:
            path = os.path.join(self.path, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat_mod.S_ISREG(st.st_mode):
                self.discard_corrupt(path, st, reason)

    def close(self):
        self.counters.close()
        with self.lock:
            self.index.close()

    def report(self):
        """KVStore.stats() but the remote tier's: this process's counters,
        the directory's size and budget, its models, pins, write budget and
        how a durable save syncs."""
        with self.lock:
            self.index.refresh()
            out = dict(self.stats)
            # What this process's saves stored of their tensors' bytes (kv_codec).
            out["kv_ratio"] = out["kv_stored_bytes"] / out["kv_raw_bytes"] if out["kv_raw_bytes"] else None
            out["entries"] = len(self.index.entries)
            out["bytes"] = self.index.total_bytes()
            out["budget_bytes"] = self.budget_bytes
            out["budget_derived"] = self.budget_derived
            entries = list(self.index.entries.values())
        # Every model's share of the directory and its one budget (docs/semantics.md §17).
        out["models"] = registry.summarize(entries, registry.read_registry(self.path))
        live, out["pinned_bytes"] = pins_mod.present(self.path, entries, int(time.time()))
        out["pins"] = len(live)
        out["write_budget"] = (None if self.write_budget_bytes is None
                               else self.counters.report(self.write_budget_bytes)["write_budget"])
        # How a durable save reaches the disk here (docs/semantics.md §11).
        out["sync"] = files.SYNC_PRIMITIVE if self.settings.durable else "none"
        out["sync_fallbacks"] = files.sync_fallbacks()
        return out


def still_there(e):
    """The stat of e's file while it is still the file e describes (same
    inode, where e knows it), else None."""
    try:
        st = os.stat(e.path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return None if e.inode and st.st_ino != e.inode else st


def budget_bytes_for(path, budget_mb):
    """(the disk budget in bytes, whether it was derived) of the directory at
    path: budget_mb MiB (0: unlimited), or for None the default derived from
    the size of the filesystem that holds path (policy.default_budget_bytes)."""
    if budget_mb is not None:
        return int(budget_mb * 1024 * 1024), False
    return policy.default_budget_bytes(files.filesystem_bytes(path)), True


class DirLock:
    """flock() on the directory's lock file for the length of a with block."""

    def __init__(self, path, mode):
        self.path, self.mode = path, mode

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                              | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise os_error(e.errno, self.path, "lock") from None
        try:
            fcntl.flock(self.fd, self.mode)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc):
        os.close(self.fd)          # releases the lock
