"""KVStore: the directory cache (docs/format.md §4-§8 and §11).

One directory of .kv files shared by any number of processes:

- find() hashes the prompt once and asks the index for the longest stored
  text that is a byte prefix of it (section 4);
- load() streams the payload into arrays, checks every CRC, compares the
  stored text with the prompt, records the hit in place and consumes very
  long checkpoints (section 5);
- save() writes a temporary file, fsyncs, renames into place and fsyncs the
  directory, then evicts down to the budget (sections 6 and 8);
- save_async() does the same on a background thread.

Nothing here knows about models: the tensors are named arrays and the meta is
the engine's JSON.  Corrupt files never reach the caller: they are removed (or
moved aside) and the lookup is a miss.
"""

import dataclasses
import errno
import fcntl
import logging
import os
import stat as stat_mod
import threading
import time

import numpy as np

from kvstore import _native, chain, counters, evictor, files, names, payload, policy, registry, seal, temps
from kvstore import identity as identity_mod
from kvstore import trailers as trailer_mod
from kvstore.errors import (CheckpointMissing, CheckpointOSError, CorruptCheckpoint,
                            KVStoreError, StoreClosed, UnsafePath, os_error)
from kvstore.files import RDWR_FLAGS, short_name
from kvstore.format import (CHAIN_HEAD_SIZE, LOADABLE_ABIS, PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TENSORS, PREFIX_SIZE,
                            SEALED_ABI_OFFSET, SEALED_ABIS, Entry, Header, Reason, entry_from_fd, open_checkpoint, pack_chain_head,
                            envelope_now, read_entry)
from kvstore.index import DirectoryIndex, TieredLookup
from kvstore.policy import Options
from kvstore.writer import BackgroundWriter

log = logging.getLogger("kvstore")

# ds4's default disk budget (ds4_kvstore.h).
DEFAULT_BUDGET_MB = 4096

LOCK_NAME = ".kvstore.lock"

# How a store writes: "chain" (ABI 17 blocks, docs/format.md §14) or "whole"
# (one ABI 16 file per checkpoint).  Both are always read.
LAYOUTS = ("chain", "whole")

# A load whose chain turns out to hold a corrupt block removes that block and
# the blocks after it, then looks again: the request gets the longest valid
# ancestor (or another hit).  Each try removes at least one file.
LOAD_TRIES = 3

# Orphaned blocks (a chain broken by a crash or another tool) are removed
# under the directory lock; a lookup that sees some tries at most this often.
ORPHAN_SWEEP_INTERVAL_S = 10.0

# The directory counters (kvstore.counters) that KVStore.stats() knows by
# another name; the others have the same name in both.
_STAT_KEYS = {"bytes_written": "bytes_saved", "bytes_read": "bytes_loaded", "save_seconds": "save_s",
              "load_seconds": "load_s"}
_COUNTED = frozenset(counters.COUNTER_NAMES) | frozenset(counters.HISTOGRAMS)

# Openers of remote tiers by URL scheme ("s3"), registered by the tier's own
# package (kvstore.remote) so that this module never imports a room above it.
_REMOTE_OPENERS = {}


def register_remote(scheme, opener):
    """Makes KVStore(remote="<scheme>://...") open a tier with opener.

    Args:
        scheme: the URL scheme, such as "s3".
        opener: callable(url, store, options) returning the tier object.
    """
    _REMOTE_OPENERS[scheme] = opener


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint: the exact tokens, the tensors and the engine meta."""
    entry: Entry
    tokens: np.ndarray
    tensors: dict
    meta: dict
    text_bytes: bytes = dataclasses.field(repr=False)
    # Prompt content too (the tool-call text map): kept out of repr, like the text.
    trailers: dict = dataclasses.field(default_factory=dict, repr=False)
    # name -> axis of the tensors that hold one row per token (KVStore.save's
    # positional=), as the file recorded them.
    positional: dict = dataclasses.field(default_factory=dict)
    # {tokens: text length} where the stored sequence may be cut into blocks
    # (a chain's block boundaries; an exported file's "cuts").
    cuts: dict = dataclasses.field(default_factory=dict, repr=False)
    # name -> the dtype the file stores (a NumPy load gives bfloat16 as uint16).
    dtypes: dict = dataclasses.field(default_factory=dict, repr=False)


def _as_bytes(text):
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"prompt text must be str or bytes, not {type(text).__name__}")


class KVStore:
    """A directory of KV checkpoints.

    Args:
        path: the directory; created 0700 if missing.
        budget_mb: disk budget for every valid .kv file in the directory.
        model_id: header model id of this engine's checkpoints (0..255).
        quant_bits: quant bits of the model weights (2,3,4,5,6,8 or 16).
        ctx_size: the engine's context size; checkpoints made with a larger
            context are never loaded.  None: no limit (header gets 0).
        reject_different_quant: make quant part of the match.
        options: kvstore.Options (min_tokens, cold_max_tokens, ...).
        durable: sync file and directory on save (crash-safe publish): fsync
            on Linux, F_FULLFSYNC on macOS (kvstore.files.sync_fd).
        verify: check every payload CRC on load.
        quarantine: move corrupt files to <dir>/.quarantine instead of deleting.
        max_age_s: remove checkpoints not used for this long (None: keep).
        remote: ``s3://bucket/prefix``: share checkpoints through a bucket on
            any S3-compatible store, a second tier behind this directory
            (kvstore.remote; needs boto3: ``pip install 'kvstore[s3]'``).
        remote_options: dict for the remote tier: endpoint_url, region,
            profile, connect_timeout, read_timeout, refresh_interval_s,
            upload_queue, ... (kvstore.remote.resolve_options lists them).
            Credentials come from the standard AWS chain, never from here.
        model_identity: the exact model this store holds state of: a string
            (kvstore.mlx.model_fingerprint(model), or a name of the exact
            artifact such as its repository and revision) or a
            kvstore.identity.ModelIdentity.  Every file the store writes
            records it (the header's model tag, the name's namespace, the
            manifest), and lookups and loads offer only its own files:
            another model's are foreign (listed, counted in the budget,
            evictable, never loaded), so that many models can share one
            directory and one budget (docs/format.md §17).  It also makes
            the remote key prefix.  None (the default): files that name no
            model, as before identities (the raw tensor store).
        accept_unidentified: with model_identity, also find and load files
            that name no model (written before identities, or by a store
            without one): they may be another model's state.
        layout: "chain" (the default) stores a sequence as a chain of blocks
            of block_tokens tokens, each token's state written once, every
            block boundary a hit (payload ABI 17); "whole" writes one ABI 16
            file per checkpoint.  Both layouts are read whatever this says.
        block_tokens: the chain grid, in tokens (default 256).
        max_write_mb_per_hour: an SSD write budget: a token bucket of this
            many MiB, refilled at this many MiB an hour, shared by every
            process using the directory (docs/format.md §15).  When it runs
            low, saves are skipped in order of value (kvstore.policy
            .write_allowed): waypoints and evict states first, anchors last.
            None (the default): no budget.
        key: seal every file this store writes (docs/format.md §16): 32
            raw bytes, or the path of a key file (``kvstore key new FILE``;
            mode 0600, 32 bytes).  Text, payload and trailer are encrypted
            and authenticated (AES-256-GCM), names are keyed MACs; a file
            that fails authentication is treated as corrupt.  Header fields
            (sizes, token counts, times, reason, model id) stay readable.
            None (the default): files are plain; sealed files are foreign.
        accept_unsealed: with a key, also find and load plain files (by
            default a keyed store ignores them: anyone who can write to the
            directory could have planted them).
    """

    def __init__(self, path, budget_mb=DEFAULT_BUDGET_MB, model_id=0, quant_bits=16,
                 ctx_size=None, reject_different_quant=False, options=None, durable=True,
                 verify=True, quarantine=False, max_age_s=None, remote=None, remote_options=None,
                 model_identity=None, layout="chain", block_tokens=chain.DEFAULT_BLOCK_TOKENS,
                 max_write_mb_per_hour=None, key=None, accept_unsealed=False, accept_unidentified=False):
        self.path = os.path.abspath(os.fspath(path))
        self.identity = identity_mod.as_identity(model_identity)      # ValueError if bad
        self.accept_unidentified = bool(accept_unidentified) and self.identity is not None
        self._seal = seal.Sealer(key, self.identity) if key is not None else None    # BadKey if bad
        self.sealed = self._seal is not None
        self._abis = LOADABLE_ABIS if not self.sealed else SEALED_ABIS | (LOADABLE_ABIS if accept_unsealed
                                                                          else frozenset())
        self.write_budget_bytes = counters.budget_capacity(max_write_mb_per_hour)   # ValueError if bad
        if budget_mb is None or budget_mb < 0:
            raise ValueError(f"budget_mb={budget_mb!r} must be a number >= 0")
        if not 0 <= int(model_id) <= 255:
            raise ValueError(f"model_id={model_id!r} is outside 0..255")
        Header(quant_bits=quant_bits, tokens=1, ctx_size=0, payload_bytes=0).pack()  # validates
        if ctx_size is not None and not 0 < int(ctx_size) < 2**32:
            raise ValueError(f"ctx_size={ctx_size!r} must be a positive u32 or None")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}; expected one of {', '.join(LAYOUTS)}")
        if type(block_tokens) is not int or not 0 < block_tokens < 2**32:
            raise ValueError(f"block_tokens={block_tokens!r} must be a positive int")
        self.layout = layout
        self.block_tokens = block_tokens
        self.budget_bytes = int(budget_mb * 1024 * 1024)
        self.model_id = int(model_id)
        self.quant_bits = quant_bits
        self.ctx_size = None if ctx_size is None else int(ctx_size)
        self.reject_different_quant = bool(reject_different_quant)
        self.options = options if options is not None else Options()
        self.durable = durable
        self.verify = verify
        self.quarantine = quarantine
        self.max_age_s = max_age_s
        self._closed = False
        self._writer = None
        self._writer_pid = None
        self._lock = threading.RLock()
        self._stats = dict(hits=0, misses=0, loads=0, bytes_loaded=0, load_s=0.0, saves=0,
                           bytes_saved=0, save_s=0.0, refused=0, save_errors=0, evictions=0,
                           bytes_evicted=0, corrupt=0, consumed=0, stores_skipped_write_budget=0,
                           canary_checks=0, canary_failures=0)
        self._open_dir()
        # The directory's own counters, shared with every process using it.
        self._counters = counters.DirectoryCounters(self.path)
        if self.write_budget_bytes is not None:
            # Records this process's capacity (and clamps the level to it).
            self._counters.take(0, self.write_budget_bytes, lambda available: True)
        self._index = DirectoryIndex(self.path, lambda e: self.misfit(e) is None, self.options.min_tokens,
                                     self._lookup_keys(bool(accept_unsealed)))
        self._orphans_swept = 0.0
        self._lookup = TieredLookup(self._index)
        for name in temps.remove_stale_temps(self.path):
            log.info("kvstore: stale_tmp_removed file=%s", short_name(name))
        self.evict()            # lists the directory (the first index refresh) and applies the budget
        self.remote = None if remote is None else self._open_remote(remote, remote_options)

    # -- set-up ------------------------------------------------------------

    def _open_dir(self):
        try:
            files.make_dir(self.path, self.durable)
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
            # Names the model in kvstore ls and stats (docs/format.md §17).
            with self._dir_lock(fcntl.LOCK_EX):
                registry.record(self.path, self.identity, self.durable)

    def _open_remote(self, url, options):
        scheme = url.partition("://")[0] if isinstance(url, str) else None
        opener = _REMOTE_OPENERS.get(scheme)
        if opener is None:
            raise ValueError(f"remote={url!r}: no remote tier for this scheme "
                             f"(known: {', '.join(sorted(_REMOTE_OPENERS)) or 'none'})")
        return opener(url, self, options)

    def _check_open(self):
        if self._closed:
            raise StoreClosed(f"KVStore({self.path!r}) is closed")

    # -- lookup (section 4) ------------------------------------------------

    def misfit(self, entry, ctx_size=None):
        """Why this store cannot load a checkpoint, or None when it fits (kvstore.policy.misfit).

        Args:
            entry: an Entry.
            ctx_size: the context to judge against (default: the store's).
        """
        ctx = self.ctx_size if ctx_size is None else ctx_size
        return policy.misfit(entry, self.model_id, ctx, self.quant_bits, self.reject_different_quant, self._abis,
                             self._key_id, self.model_tag, self.accept_unidentified)

    @property
    def model_identity(self):
        """The identity string of the store's model, or None (kvstore.identity)."""
        return None if self.identity is None else self.identity.fingerprint

    @property
    def model_tag(self):
        """The header model tag of the store's files (0: they name no model)."""
        return 0 if self.identity is None else self.identity.tag

    @property
    def sealer(self):
        """The kvstore.seal.Sealer of the store's key, or None (a plain store)."""
        return self._seal

    @property
    def _key_id(self):
        """The id of the store's key (a sealed store's); None for a plain store."""
        return None if self._seal is None else self._seal.key_id

    @property
    def _name_key(self):
        """The kvstore.names.NameKey of the files this store writes (None: SHA1 names)."""
        if self._seal is not None:
            return self._seal.names
        return None if self.identity is None else self.identity.names

    def _key_of(self, entry):
        """The NameKey entry's name was made with (an entry this store may load:
        sealed with its key or plain, naming its model or none)."""
        if entry.sealed:
            return self._seal.names_for(entry.model_tag)
        return self.identity.names if entry.model_tag and self.identity is not None else None

    def _lookup_keys(self, accept_unsealed):
        """The NameKeys a lookup hashes the prompt under, the store's own first:
        one pass each (kvstore.forest.prefix_matches)."""
        keys = [self._name_key]
        if self._seal is not None and accept_unsealed:
            keys.append(None if self.identity is None else self.identity.names)
        if self.accept_unidentified:
            keys.append(self._seal.names_for(0) if self._seal is not None else None)
            if self._seal is not None and accept_unsealed:
                keys.append(None)
        return tuple(dict.fromkeys(keys))

    def _open_plain(self, fd, st, entry):
        """(source, Entry) of a file's plain bytes: its descriptor, or a sealed
        file's kvstore.seal.SealedSource, which authenticates what it reads."""
        if not entry.sealed:
            return fd, entry
        return self._seal.source(fd, st, entry)

    def _eligible(self, e, min_tokens=None):
        if min_tokens is None:
            min_tokens = self.options.min_tokens
        return e.tokens >= min_tokens and self.misfit(e) is None

    def find(self, prompt, accept=None):
        """The entry with the longest stored text that is a byte prefix of prompt.

        Every loadable block of a complete chain counts, as does every ABI 16
        file (docs/format.md §4, §14).

        Args:
            prompt: str (UTF-8) or bytes.
            accept: optional predicate on a local Entry; a match it refuses
                is passed over for the next longest (a caller that can use
                only some cut points, say whole UTF-8 characters).

        Returns:
            Entry, or None on a miss.
        """
        self._check_open()
        data = _as_bytes(prompt)
        with self._lock:
            self._index.refresh()
            # Both tiers in one SHA1 pass, from memory; a remote hit only
            # when longer than the best local one.
            e, sha = self._lookup.longest_prefix(data, self.remote.searchable() if self.remote else None,
                                                 accept)
            if sha is not None:
                e = self.remote.entry(sha)
            orphans = bool(self._index.orphans)
        if e is None:
            self._count(misses=1)
        if orphans:
            self._sweep_orphans()
        return None if e is None else dataclasses.replace(e, query=data, accept=accept)

    # -- load (section 5) --------------------------------------------------

    def load(self, entry, into="numpy", *, min_tokens=None, consume=True):
        """Loads a checkpoint found by find() (or listed by entries()).

        Args:
            entry: an Entry.
            into: "numpy" or "mlx" (arrays of that library; bfloat16 tensors
                come back as uint16 bit patterns in NumPy, which has no bfloat16).
            min_tokens: the shortest checkpoint this load accepts (default
                options.min_tokens).  Agent sessions, addressed by name rather
                than found by lookup, load at any length.
            consume: delete a checkpoint of more than options.cold_max_tokens
                after loading it (docs/format.md §5).  Agent sessions are kept: a
                session is switched back to, not taken over.

        Returns:
            Checkpoint, or None when the file vanished, is corrupt (it is then
            removed or quarantined) or its text does not match the prompt.
        """
        self._check_open()
        if into not in ("numpy", "mlx"):
            raise ValueError(f"into={into!r}; expected 'numpy' or 'mlx'")
        t0 = time.perf_counter()
        if entry.remote is not None:
            entry = self._fetch_remote(entry, min_tokens)
            if entry is None:
                return None
        if entry.is_block:
            return self._load_chain(entry, into, min_tokens, t0)
        try:
            fd, st = open_checkpoint(entry.path)
        except CheckpointMissing:
            log.info("kvstore: miss reason=vanished file=%s", short_name(entry.name))
            return self._miss(entry)
        except CheckpointOSError as e:
            log.warning("kvstore: miss reason=unreadable file=%s errno=%s", short_name(entry.name), e.errno)
            return self._miss(entry)
        try:
            cur = entry_from_fd(fd, st, entry.path)
            if not self._eligible(cur, min_tokens) or cur.is_block:
                # Rewritten since the lookup (another model, context, ABI...).
                log.info("kvstore: miss reason=not_eligible abi=%d file=%s", cur.payload_abi, short_name(entry.name))
                return self._miss(entry)
            # A sealed file is read in place: each read decrypts and
            # authenticates the chunks it covers before it returns.
            rfd, plain = self._open_plain(fd, st, cur)
            text = payload.pread(rfd, plain.text_bytes, PREFIX_SIZE)
            if len(text) != plain.text_bytes:
                raise CorruptCheckpoint("truncated", entry.path, "text cut short")
            if plain.sha and names.name_of(text, self._key_of(cur)).hex() != plain.sha:
                raise CorruptCheckpoint("text_hash", entry.path, "stored text does not hash to the file name")
            if entry.query is not None and entry.query[:len(text)] != text:
                # A SHA1 collision: the digests matched, the bytes do not.
                log.warning("kvstore: miss reason=text_mismatch file=%s", short_name(entry.name))
                return self._miss(entry)
            # The GCM tags already vouch for every byte of a sealed file.
            verify = self.verify and not cur.sealed
            manifest = payload.read_manifest(rfd, plain)
            self._check_model(cur, manifest.model)
            tokens = payload.read_tokens(rfd, plain, manifest, verify)
            if into == "mlx":
                tensors = payload.read_tensors_mlx(rfd, plain, manifest, verify)
            else:
                tensors = payload.read_tensors_numpy(rfd, plain, manifest, verify)
            trailer_values = {}
            if plain.file_size > plain.trailer_offset:
                raw = payload.pread(rfd, plain.file_size - plain.trailer_offset, plain.trailer_offset)
                trailer_values, _, _ = trailer_mod.parse_trailer(raw, cur.path, log)
            # With fd still open the inode cannot be reused: the hit goes to
            # the file just read, never to a newer one renamed over its name.
            hits = files.record_hit(entry.path, st, cur.hits)
        except CorruptCheckpoint as e:
            self._discard_corrupt(entry.path, st, e.reason)
            return self._miss(entry)
        finally:
            os.close(fd)

        if consume and cur.tokens > self.options.cold_max_tokens:
            # The live session now owns this state and writes fresh waypoints.
            self._unlink_if_same(entry.path, st)
            self._count(consumed=1)
        dt = time.perf_counter() - t0
        self._count(hits=1, loads=1, bytes_read=cur.file_size, load_seconds=dt)
        log.info("kvstore: hit tokens=%d text=%d load_ms=%.1f file=%s", cur.tokens, cur.text_bytes,
                 dt * 1e3, short_name(entry.name))
        cur = dataclasses.replace(cur, hits=hits)
        return Checkpoint(entry=cur, tokens=tokens, tensors=tensors, meta=manifest.meta,
                          text_bytes=text, trailers=trailer_values, positional=dict(manifest.axes),
                          cuts=dict(manifest.cuts), dtypes={t[0]: t[1] for t in manifest.tensors})

    def _load_chain(self, entry, into, min_tokens, t0, tries=LOAD_TRIES):
        """load() of a chain block: every block of its chain into one allocation per tensor.

        A corrupt block removes itself and the blocks after it; the load
        then falls back to the longest valid ancestor that stands on its own
        (the same prompt prefixes it), or is a miss.
        """
        with self._lock:
            self._index.refresh()
            cur = self._index.get(entry.sha)
            blocks = self._index.chain(cur) if cur is not None else None
        if blocks is None:
            # Not in the index, or its chain is broken there: the directory
            # says why.  A block damaged since the lookup drops out of the
            # index when it is listed again; find it by walking the chain.
            bad, end, reason = self._walk_chain(entry)
            if bad is None:
                log.info("kvstore: miss reason=%s file=%s", reason, short_name(entry.name))
                return self._miss(entry)
            self._discard_block(bad, reason)
            return self._fall_back(entry, end, into, min_tokens, t0, tries)
        sealed = any(b.sealed for b in blocks)
        if (sealed and not all(b.sealed for b in blocks)) or any(self.misfit(b) is not None for b in blocks):
            # Not this store's (another key, model, ABI...): a miss; the files stay.
            log.info("kvstore: miss reason=not_eligible file=%s", short_name(entry.name))
            return self._miss(entry)
        opener = self._open_plain if sealed else None
        try:
            with chain.OpenChain(blocks, opener, self._key_of(blocks[-1])) as opened:
                target = opened.entries[-1]
                # A sealed chain's plain copies carry the plain ABI: its
                # eligibility is the sealed files' (same header fields).
                judged = [_as_sealed(b, bst) for _, bst, b in opened.blocks] if sealed else opened.entries
                if not self._eligible(judged[-1], min_tokens) or not target.restorable:
                    log.info("kvstore: miss reason=not_eligible file=%s", short_name(entry.name))
                    return self._miss(entry)
                if any(self.misfit(b) is not None for b in judged):
                    log.info("kvstore: miss reason=not_eligible file=%s", short_name(entry.name))
                    return self._miss(entry)
                text = opened.text()
                if entry.query is not None and entry.query[:len(text)] != text:
                    log.warning("kvstore: miss reason=text_mismatch file=%s", short_name(entry.name))
                    return self._miss(entry)
                layout = opened.layout()
                self._check_model(target, layout.model)
                read = payload.read_chain_mlx if into == "mlx" else payload.read_chain_numpy
                tokens, tensors = read(layout, self.verify and not sealed)
                fd, st, _ = opened.blocks[-1]
                trailer_values = {}
                if target.file_size > target.trailer_offset:
                    raw = payload.pread(fd, target.file_size - target.trailer_offset, target.trailer_offset)
                    trailer_values, _, _ = trailer_mod.parse_trailer(raw, target.path, log)
                # Every block read counts a hit: a block's score then holds
                # the loads that passed through it (docs/format.md §14).
                hits = [files.record_hit(b.path, bst, b.hits) for _, bst, b in opened.blocks]
                nbytes = sum(b.file_size for b in opened.entries)
        except CheckpointMissing:
            log.info("kvstore: miss reason=vanished file=%s", short_name(entry.name))
            return self._miss(entry)
        except CheckpointOSError as e:
            log.warning("kvstore: miss reason=unreadable file=%s errno=%s", short_name(entry.name), e.errno)
            return self._miss(entry)
        except CorruptCheckpoint as e:
            at = next((i for i, b in enumerate(blocks) if b.path == e.path), len(blocks) - 1)
            self._discard_block(blocks[at], e.reason)
            return self._fall_back(entry, blocks[at].text_bytes, into, min_tokens, t0, tries)
        dt = time.perf_counter() - t0
        self._count(hits=1, loads=1, bytes_read=nbytes, load_seconds=dt)
        log.info("kvstore: hit tokens=%d text=%d blocks=%d load_ms=%.1f file=%s", target.tokens,
                 target.text_bytes, len(blocks), dt * 1e3, short_name(entry.name))
        target = dataclasses.replace(judged[-1], hits=hits[-1])
        return Checkpoint(entry=target, tokens=tokens, tensors=tensors, meta=layout.meta,
                          text_bytes=text, trailers=trailer_values, positional=dict(layout.axes),
                          cuts={b.tokens: b.text_bytes for b in blocks},
                          dtypes={t.name: t.dtype for t in layout.tensors})

    def _fall_back(self, entry, limit, into, min_tokens, t0, tries):
        """After a bad block (removed with the blocks after it): load the longest
        valid hit for the same prompt shorter than limit text bytes (an
        ancestor of the bad block, or another chain's), or count a miss."""
        if entry.query is None or tries <= 1:
            return self._miss(entry)

        def shorter(e):
            return e.text_bytes < limit and (entry.accept is None or entry.accept(e))
        with self._lock:
            self._index.refresh()
            back = self._index.longest_prefix(entry.query, shorter)
        if back is None:
            return self._miss(entry)
        log.info("kvstore: retry reason=corrupt_block tokens=%d file=%s", back.tokens, short_name(back.name))
        back = dataclasses.replace(back, query=entry.query, accept=entry.accept)
        if back.is_block:
            return self._load_chain(back, into, min_tokens, t0, tries - 1)
        return self.load(back, into, min_tokens=min_tokens)

    def _walk_chain(self, entry):
        """Walks entry's chain on disk, from entry towards its first block.

        Returns:
            (the first bad block met, or None; the text length it ends at;
            the corruption reason, or the miss reason when nothing is bad:
            "vanished" or "broken_chain").
        """
        try:
            cur = read_entry(os.path.join(self.path, entry.sha + ".kv"))
        except CorruptCheckpoint as e:
            return entry, entry.text_bytes, e.reason
        except KVStoreError:
            return None, 0, "vanished"
        try:
            for _ in files.ancestors(cur, self.path, limit=len(self._index.entries) + 1):
                pass
        except files.BrokenChain as broken:
            if isinstance(broken.error, CorruptCheckpoint):
                path = os.path.join(self.path, broken.name + ".kv")
                bad = dataclasses.replace(broken.child, path=path, sha=broken.name, inode=0)
                return bad, broken.child.text_start, broken.error.reason
        return None, 0, "broken_chain"

    def _discard_block(self, entry, reason, quarantine=None):
        """A bad block goes (removed or quarantined) with the blocks after it in its chains."""
        with self._lock:
            after = self._index.descendants(entry)
        try:
            st = os.stat(entry.path, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and (not entry.inode or st.st_ino == entry.inode):
            self._discard_corrupt(entry.path, st, reason, quarantine)
        for e in after:
            if self._unlink_entry(e):
                log.info("kvstore: block_removed reason=parent_corrupt file=%s", short_name(e.name))

    def _unlink_entry(self, e):
        """Unlinks the file of e if it is still that file (same inode); True when it did."""
        try:
            st = os.stat(e.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if e.inode and st.st_ino != e.inode:
            return False
        return self._unlink_if_same(e.path, st)

    def _fetch_remote(self, entry, min_tokens):
        """The local Entry to load for a remote hit: the fetched copy, or, when
        the fetch is a miss, the best local hit for the same prompt (None if none)."""
        if os.path.lexists(entry.path):      # fetched or saved here meanwhile
            return dataclasses.replace(entry, remote=None)
        published = []
        got = self.remote.fetch(entry, lambda e: self._eligible(e, min_tokens), self.budget_bytes, self.durable,
                                fits=lambda e: self.misfit(e) is None, have=self._has_block, published=published)
        if published:
            with self._lock:
                self._index.add(*published)
        if got is not None:
            self._evict_if_over(got)
            return dataclasses.replace(got, query=entry.query)
        with self._lock:
            self._index.refresh()
            local = self._index.longest_prefix(entry.query, entry.accept) if entry.query is not None else None
        if local is None:
            self._count(misses=1)
            return None
        return dataclasses.replace(local, query=entry.query)

    def _has_block(self, sha):
        """True when the block named sha is here (for a remote fetch of its chain)."""
        with self._lock:
            self._index.refresh()
            return self._index.get(sha) is not None

    def _check_model(self, entry, model):
        """A file that names a model (its tag) must carry that model's identity
        in its manifest: one whose tag and name say this store's model but
        whose manifest says another is not what it claims (corrupt).

        Raises:
            CorruptCheckpoint: "model_mismatch".
        """
        if entry.model_tag and model != self.model_identity:
            raise CorruptCheckpoint("model_mismatch", entry.path, "manifest names another model than the header")

    def _miss(self, entry):
        with self._lock:
            if not os.path.lexists(entry.path):
                self._index.discard(entry.name)
        self._count(misses=1)
        return None

    def _unlink_if_same(self, path, st):
        """Unlinks path only if it is still the file we opened (not a newer save)."""
        if not files.unlink_if_same(path, st):
            return False
        with self._lock:
            self._index.discard(os.path.basename(path))
        return True

    def discard(self, entry, reason, quarantine=None):
        """Removes (or quarantines) a checkpoint found unusable by a caller.

        For engines that load a payload and then find it cannot be used (a
        cache that does not rebuild, say).  The file is removed only if it is
        still the one the entry describes (same inode), never a newer save;
        a chain block takes the blocks after it along.

        Args:
            entry: the Entry (a Checkpoint's).
            reason: a word for the log line.
            quarantine: move it to <dir>/.quarantine instead of deleting it
                (None: the store's own setting).

        Returns:
            True when the file was removed or moved aside.
        """
        try:
            st = os.stat(entry.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if entry.inode and st.st_ino != entry.inode:
            return False
        if entry.is_block:
            self._discard_block(entry, reason, quarantine)
        else:
            self._discard_corrupt(entry.path, st, reason, quarantine)
        return not os.path.lexists(entry.path)

    def record_canary(self, entry, ok, detail=""):
        """Counts a canary check of a restored checkpoint (kvstore.mlx.canary).

        A failed one (the live model would not have produced the stored
        state: another model's weights, RoPE or KV dtype, or damage no CRC
        caught) is logged and quarantined, so that no later request loads
        it and a person can look at it.

        Args:
            entry: the restored Checkpoint's Entry.
            ok: the canary's verdict.
            detail: key=value words for the log line (never prompt text).
        """
        self._count(canary_checks=1, canary_failures=0 if ok else 1)
        if ok:
            return
        log.warning("kvstore: canary_failed tokens=%d %s file=%s", entry.tokens, detail, short_name(entry.name))
        self.discard(entry, "canary", quarantine=True)

    def _discard_torn(self):
        """Removes (or quarantines) the files whose envelope is torn (a power
        loss's debris, kvstore.index.TORN_REASONS); under the exclusive lock."""
        with self._lock:
            torn = self._index.torn
        for name, reason in torn:
            path = os.path.join(self.path, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat_mod.S_ISREG(st.st_mode):
                self._discard_corrupt(path, st, reason)

    def _discard_corrupt(self, path, st, reason, quarantine=None):
        name = os.path.basename(path)
        self._count(corrupt=1)
        if self.quarantine if quarantine is None else quarantine:
            try:
                files.quarantine(path, self.path)
                with self._lock:
                    self._index.discard(name)
                action = "quarantined"
            except OSError:
                action = "kept"
        else:
            action = "removed" if self._unlink_if_same(path, st) else "kept"
        log.warning("kvstore: corrupt reason=%s action=%s file=%s", reason, action, short_name(name))

    # -- save (section 6) --------------------------------------------------

    def _count(self, **deltas):
        """Adds to this process's stats and to the directory's counters.

        The one place both change, so they never disagree.  Names are the
        directory's (kvstore.counters: saves, bytes_written, loads,
        bytes_read, hits, misses, evictions, bytes_evicted, corrupt,
        stores_skipped_write_budget, and the save_seconds and load_seconds
        histograms, given in seconds); stats() keeps bytes_written,
        bytes_read and the seconds under its older names (_STAT_KEYS).
        Names the directory does not count (refused, save_errors, consumed)
        stay in this process.
        """
        with self._lock:
            for k, v in deltas.items():
                self._stats[_STAT_KEYS.get(k, k)] += v
        # The file's lock is never taken under the store's.
        shared = {k: v for k, v in deltas.items() if k in _COUNTED}
        if shared:
            self._counters.add(**shared)

    def _refuse(self, why, **kv):
        self._count(refused=1)
        extra = "".join(f" {k}={v}" for k, v in kv.items())
        log.info("kvstore: save_refused reason=%s%s", why, extra)
        return None

    def save(self, text, tokens, tensors, meta=None, reason=Reason.COLD, ctx_size=None,
             trailers=None, *, min_tokens=None, positional=None, text_offsets=None, dtypes=None):
        """Stores a checkpoint for the prompt text.

        With layout "chain" (the default) the state is cut into blocks of
        block_tokens tokens and only the blocks not stored yet are written,
        parent first, each durable (docs/format.md §14); the returned entry
        is the last block.  Cutting needs text_offsets and knowing which
        tensors grow along the sequence (positional); without them the save
        is one block.

        Args:
            text: the rendered prompt prefix (str or bytes) the state belongs to.
            tokens: the exact token ids prefilled for it (sequence or array).
            tensors: dict name -> numpy or MLX array.
            meta: engine JSON (dict) stored in the manifest.
            reason: kvstore.Reason.
            ctx_size: context size the state was made with (default: the store's).
            trailers: dict ext-bit -> value for the trailer hooks (docs/format.md §10).
            min_tokens: refuse fewer tokens than this (default
                options.min_tokens); agent sessions are saved at any length.
            positional: dict name -> axis of every tensor that holds one row
                per token along that axis (KV caches); the others are
                snapshots of the state at the end.
            text_offsets: the byte length of the text of the first i tokens,
                for i in 0..len(tokens) (a sequence of len(tokens) + 1 ints,
                or a callable i -> int, or a dict {i: length} of some cut
                points): where blocks may be cut.
            dtypes: name -> the dtype to record for a tensor whose array
                cannot hold it (bfloat16 bits in a NumPy uint16 array).

        Returns:
            the new (or kept) Entry, or None when refused (too few tokens, over
            budget) or when the disk failed; the log says why.
        """
        self._check_open()
        text = _as_bytes(text)
        tokens = _token_array(tokens)
        if tokens.size and (tokens.dtype.kind not in "ui" or tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError("tokens must be integer ids in 0..2**32-1")
        if len(text) >= 2**32:
            raise ValueError(f"text of {len(text)} bytes is longer than 2**32-1")
        n = int(tokens.size)
        if min_tokens is None:
            min_tokens = self.options.min_tokens
        if n == 0 or n < min_tokens:
            return self._refuse("min_tokens", tokens=n, min_tokens=min_tokens)
        ctx = self.ctx_size if ctx_size is None else int(ctx_size)
        axes = _check_axes(positional, tensors, n)
        values = {trailer_mod.bit_index(k): v for k, v in (trailers or {}).items()}
        trailer_raw, ext = trailer_mod.encode_trailer(values) if values else (b"", 0)
        if self.layout == "chain":
            return self._save_chain(text, tokens, tensors, meta, Reason(reason), ctx, values, trailer_raw, ext,
                                    axes, text_offsets, dtypes)
        plan = payload.Plan(len(text), tokens, tensors, meta, axes=axes, dtypes=dtypes, model=self.model_identity)
        if self.budget_bytes and not policy.file_size_fits(len(text), plan.payload_bytes, len(trailer_raw),
                                                           self.budget_bytes):
            return self._refuse("budget", bytes=PREFIX_SIZE + len(text) + plan.payload_bytes,
                                budget=self.budget_bytes)
        (digest,), (tag,) = names.names_of(text, [len(text)], self._name_key)
        sha = digest.hex()
        name = sha + ".kv"
        path = os.path.join(self.path, name)
        t0 = time.perf_counter()
        try:
            kept = self._keep_existing(path, text, ctx, values, Reason(reason))
            if kept is not None:
                if self.remote is not None:
                    self.remote.enqueue(kept)
                return kept
            if self._over_write_budget(Reason(reason), PREFIX_SIZE + len(text) + plan.payload_bytes
                                       + len(trailer_raw)):
                return None
            header = Header(quant_bits=self.quant_bits, tokens=n, ctx_size=ctx or 0,
                            payload_bytes=plan.payload_bytes, reason=Reason(reason),
                            ext_flags=ext, model_id=self.model_id, payload_abi=PAYLOAD_ABI_TENSORS,
                            created_at=int(time.time()), last_used=0, model_tag=self.model_tag)
            entry = self._write(path, header, text, plan, trailer_raw, durable=self.durable, lookup_tag=tag)
        except OSError as e:
            self._count(save_errors=1)
            log.warning("kvstore: save_failed errno=%s error=%s file=%s", e.errno,
                        errno.errorcode.get(e.errno, "?"), short_name(name))
            return None
        dt = time.perf_counter() - t0
        with self._lock:
            self._index.add(entry)
        self._count(saves=1, bytes_written=entry.file_size, save_seconds=dt)
        log.info("kvstore: saved reason=%s tokens=%d text=%d bytes=%d save_ms=%.1f file=%s",
                 Reason(reason).name.lower(), n, len(text), entry.file_size, dt * 1e3, short_name(name))
        if self.remote is not None:
            self.remote.enqueue(entry)       # never blocks: a background thread uploads
        self._evict_if_over(entry, text)
        return entry

    def _save_chain(self, text, tokens, tensors, meta, reason, ctx, values, trailer_raw, ext, axes, text_offsets,
                    dtypes=None):
        """save() in the chain layout: the blocks not stored yet, parent first."""
        blocks = chain.plan_blocks(text, tokens, self.block_tokens, text_offsets, self._name_key)
        snapshots = any(k not in axes for k in tensors)
        last = blocks[-1]
        t0 = time.perf_counter()
        written, kept = [], None
        nbytes = 0              # of the files this save wrote (not those another writer published first)
        try:
            # Evictors (exclusive lock) wait while the blocks go in, so no
            # parent this save relies on is removed under it.
            with self._dir_lock(fcntl.LOCK_SH):
                todo, have = [], 0
                for b in blocks:
                    restorable = b.last or not snapshots
                    path = os.path.join(self.path, b.name)
                    if b.last:
                        kept = self._keep_existing(path, text, ctx, values, reason, block=b)
                        if kept is not None:
                            have += kept.file_size
                            continue
                    else:
                        cur = self._current_authentic(path)
                        if chain.same_block(cur, b) and self.misfit(cur, ctx) is None \
                                and (cur.restorable or not restorable):
                            have += cur.file_size
                            continue
                    seg = text[b.text_start:b.text_bytes]
                    plan = payload.Plan(len(seg), tokens[b.token_start:b.tokens],
                                        chain.block_tensors(tensors, axes, b, restorable), meta, axes=axes,
                                        head=CHAIN_HEAD_SIZE, dtypes=dtypes, model=self.model_identity)
                    todo.append((b, restorable, path, seg, plan, trailer_raw if b.last else b""))
                total = sum(PREFIX_SIZE + len(seg) + plan.payload_bytes + len(tr) for _, _, _, seg, plan, tr in todo)
                # The whole chain must fit: the blocks it already has stay.
                if self.budget_bytes and not policy.bytes_fit(have + total, self.budget_bytes):
                    return self._refuse("budget", bytes=have + total, budget=self.budget_bytes)
                # Only the blocks really to be written draw on the write budget.
                if self._over_write_budget(reason, total):
                    return None
                now = int(time.time())
                for b, restorable, path, seg, plan, tr in todo:
                    header = Header(quant_bits=self.quant_bits, tokens=b.tokens, ctx_size=ctx or 0,
                                    payload_bytes=plan.payload_bytes,
                                    reason=reason if b.last else Reason.CONTINUED,
                                    ext_flags=ext if b.last else 0, model_id=self.model_id,
                                    payload_abi=PAYLOAD_ABI_CHAIN, created_at=now, last_used=0,
                                    model_tag=self.model_tag)
                    head = pack_chain_head(b.parent_digest, b.token_start, b.text_start, self.block_tokens,
                                           b.flags(restorable), b.token_digest, b.parent_token_digest)
                    # A new name is taken only if still free: of two writers
                    # of the same block the first wins, and the chains that
                    # already continue it keep their parent.
                    e = self._write(path, header, seg, plan, tr, head, self.durable,
                                    exclusive=not os.path.lexists(path), lookup_tag=b.lookup_tag)
                    if e is None:
                        e = self._current_authentic(path)
                        if not (chain.same_block(e, b) and (e.restorable or not restorable)):
                            e = self._write(path, header, seg, plan, tr, head, self.durable, lookup_tag=b.lookup_tag)
                            nbytes += e.file_size
                    else:
                        nbytes += e.file_size
                    written.append(e)
                with self._lock:
                    self._index.add(*written)
        except OSError as e:
            # Blocks published before the failure stay (a valid chain prefix).
            self._count(save_errors=1, bytes_written=nbytes)
            log.warning("kvstore: save_failed errno=%s error=%s blocks_written=%d file=%s", e.errno,
                        errno.errorcode.get(e.errno, "?"), len(written), short_name(last.name))
            return None
        if not written:
            if kept is not None and self.remote is not None:
                self.remote.enqueue(kept)
            return kept
        dt = time.perf_counter() - t0
        self._count(saves=1, bytes_written=nbytes, save_seconds=dt)
        log.info("kvstore: saved reason=%s tokens=%d text=%d blocks=%d written=%d bytes=%d save_ms=%.1f file=%s",
                 reason.name.lower(), last.tokens, last.text_bytes, len(blocks), len(written), nbytes, dt * 1e3,
                 short_name(last.name))
        if self.remote is not None:
            for e in written:
                self.remote.enqueue(e)       # never blocks: a background thread uploads
        entry = kept if kept is not None else written[-1]
        self._drop_replaced_tails(blocks, text)
        self._evict_if_over(entry, text)
        if not os.path.lexists(entry.path):
            # Removed at once (by another process's wipe, say): not stored.
            log.info("kvstore: save_lost reason=removed file=%s", short_name(entry.name))
            return None
        return entry

    def _drop_replaced_tails(self, blocks, text):
        """Removes the tails this chained save grew past (docs/format.md §14).

        A tail is the last block of a save that does not end on the grid (a
        server stores one at a prompt's end, so that a restart reuses all of
        it).  Once a save of the same sequence writes the whole block it lay
        in, the sequence has moved on past it: a leaf beside that whole
        block, whose text is a strict prefix of this save's, with reason
        evict or shutdown (anchors, waypoints and sessions stay), goes.
        Another tail beside it (an answer's end beside its prompt's end)
        replaces nothing.
        """
        shas = {b.sha for b in blocks}
        grid = self.block_tokens
        with self._lock:
            cands = [e for b in blocks if b.parent and b.tokens % grid == 0
                     for e in self._index.kids_in_forest(b.parent)
                     if e.sha not in shas and e.ends_save and e.block_grid and e.tokens % e.block_grid
                     and e.reason in _REPLACEABLE and e.tokens < b.tokens and e.text_bytes < len(text)]
            cands = [e for e in cands if not self._index.kids_in_forest(e.sha)]
        if not cands:
            return
        for key in {self._key_of(e) for e in cands}:
            mine = [e for e in cands if self._key_of(e) == key]
            digests, _ = names.names_of(text, [e.text_bytes for e in mine], key)
            for e, d in zip(mine, digests):
                if d.hex() == e.sha:
                    with self._dir_lock(fcntl.LOCK_EX):
                        self._delete(e, "replaced_tail")

    def _write(self, path, header, text, plan, trailer_raw=b"", head=b"", durable=True, exclusive=False,
               lookup_tag=b""):
        """files.write_checkpoint, sealed when the store has a key (with
        lookup_tag, the name's: kvstore.names.names_of)."""
        if self._seal is not None:
            return self._seal.write_checkpoint(path, header, text, plan, trailer_raw, head, durable, exclusive,
                                               lookup_tag)
        return files.write_checkpoint(path, header, text, plan, trailer_raw, head, durable, exclusive)

    def _current_authentic(self, path):
        """The envelope at path now, or None (missing, corrupt, unsafe); for a
        sealed file of this store's key, its authenticated head (real token
        digests), or None when it does not authenticate."""
        e = envelope_now(path)
        if e is None or self._seal is None or not self._seal.owns(e):
            return e
        try:
            fd, st = open_checkpoint(path)
        except KVStoreError:
            return None
        try:
            _, plain = self._seal.source(fd, st, e)
            return _as_sealed(plain, st)
        except KVStoreError:
            return None
        finally:
            os.close(fd)

    def verify_file(self, path, name=None):
        """Checks one file as a load would, without keeping arrays (kvstore verify).

        A sealed file of this store's key is authenticated chunk by chunk
        (kvstore.seal.Sealer.verify_file); any other file as
        kvstore.files.verify_file checks it.

        Args:
            path: the file.
            name: the checkpoint name it will have, for a file not yet under
                it (a download in a temporary file): a sealed file's tags
                bind its name.

        Returns:
            None when sound, else a one-line reason (never prompt text).
        """
        if self._seal is not None:
            try:
                e = read_entry(path)
            except CheckpointMissing:
                raise
            except (KVStoreError, OSError):
                e = None
            if e is not None and e.sealed:
                return self._seal.verify_file(path, name=name)
            if e is not None and e.payload_abi not in self._abis:
                return "not_sealed: a sealed store takes only sealed files"
        return files.verify_file(path, name=name)

    def _over_write_budget(self, reason, nbytes):
        """Takes nbytes from the write budget for a save of reason; True (the
        skip logged and counted) when the policy says the save must wait.

        The bucket is shared by every process on the directory
        (kvstore.counters); which reason may spend how much is
        kvstore.policy.write_allowed.
        """
        cap = self.write_budget_bytes
        if cap is None or nbytes <= 0:
            return False
        ok, available = self._counters.take(nbytes, cap,
                                            lambda level: policy.write_allowed(reason, nbytes, level, cap))
        if ok:
            return False
        self._count(stores_skipped_write_budget=1)
        log.info("kvstore: store_skipped reason=%s why=write_budget bytes=%d available=%d",
                 Reason(reason).name.lower(), nbytes, available)
        return True

    def _dir_lock(self, mode):
        """The directory's advisory lock: shared while blocks are published,
        exclusive while evicting (docs/format.md §11)."""
        return _DirLock(os.path.join(self.path, LOCK_NAME), mode)

    def _keep_existing(self, path, text, ctx, values, reason, block=None):
        """docs/format.md §6: a compatible file with the same name is kept; only its trailer changes.

        One header byte may change too: a file saved again as an agent session
        becomes one (reason byte 5), so that a named session whose text a
        server had already stored still shows in the session list.  A session
        is never demoted by a later automatic save.  For the last block of a
        chained save (block), the file on disk is kept when it is that very
        block and restorable, or a whole file of the same text.
        """
        try:
            fd, st = open_checkpoint(path, RDWR_FLAGS)
        except CheckpointMissing:
            return None
        except UnsafePath:
            return None              # a planted symlink: the rename replaces the name
        try:
            e = entry_from_fd(fd, st, path)
            if e.sealed:
                return self._keep_sealed(fd, st, e, text, ctx, values, reason, block)
            if self.misfit(e, ctx) is not None or e.text_bytes != len(text) \
                    or os.pread(fd, e.segment_bytes, PREFIX_SIZE) != text[e.text_start:]:
                return None
            # A block is kept when it stands on its own; by a chained save,
            # only when it is the very block that save would write.
            if e.is_block and (not e.restorable or (block is not None and not chain.same_block(e, block))):
                return None
            if values:
                e = self._rewrite_trailer(fd, e, values)
            if reason == Reason.AGENT_SESSION and e.reason != Reason.AGENT_SESSION:
                os.pwrite(fd, bytes([int(Reason.AGENT_SESSION)]), 5)
                if self.durable:
                    files.sync_fd(fd, data_only=True)
                e = entry_from_fd(fd, os.fstat(fd), e.path)
            with self._lock:
                self._index.add(e)
            log.info("kvstore: save_kept file=%s", short_name(e.name))
            return e
        except CorruptCheckpoint:
            # Corrupt, or made so under us (another process wiping it): not
            # kept; the save writes a fresh file and renames it over this one.
            return None
        finally:
            os.close(fd)

    def _keep_sealed(self, fd, st, e, text, ctx, values, reason, block):
        """_keep_existing for a sealed file: kept only when nothing in it
        would change.  A new trailer or a session promotion rewrites it whole
        (sealed anew under a fresh file id), never in place: both are bound
        by its tags."""
        if self.misfit(e, ctx) is not None or e.text_bytes != len(text):
            return None
        if values or (reason == Reason.AGENT_SESSION and e.reason != Reason.AGENT_SESSION):
            return None
        src, plain = self._seal.source(fd, st, e)
        if src.pread(plain.segment_bytes, PREFIX_SIZE) != text[e.text_start:]:
            return None
        if e.is_block and (not e.restorable or (block is not None
                                                and not chain.same_block(_as_sealed(plain, st), block))):
            return None
        with self._lock:
            self._index.add(e)
        log.info("kvstore: save_kept file=%s", short_name(e.name))
        return e

    def _rewrite_trailer(self, fd, e, values):
        """Merges values into the file's trailer in place; unknown sections stay.

        A crash half-way leaves a trailer section whose CRC fails: readers drop
        that section and the checkpoint itself stays usable (docs/format.md §10).
        """
        old_raw = os.pread(fd, e.file_size - e.trailer_offset, e.trailer_offset)
        old_values, sections, _ = trailer_mod.parse_trailer(old_raw, e.path, log)
        merged = {**old_values, **values}
        # encode_trailer writes back only the sections it cannot read itself.
        raw, ext = trailer_mod.encode_trailer(merged, sections)
        if raw == old_raw:
            return e
        try:
            _native.pwrite_from(fd, raw, e.trailer_offset, e.path)
            os.ftruncate(fd, e.trailer_offset + len(raw))
        except OSError:
            # A full disk half-way: put the old trailer back (it fitted
            # before), so that a failed save leaves the file as it was.
            try:
                _native.pwrite_from(fd, old_raw, e.trailer_offset, e.path)
                os.ftruncate(fd, e.trailer_offset + len(old_raw))
            except OSError:
                pass
            raise
        had = 0
        for s in sections:
            had |= 1 << s.bit
        flags = (int(e.ext_flags) & ~had & 0xFF) | ext
        os.pwrite(fd, bytes([flags]), 6)
        if self.durable:
            files.sync_fd(fd)           # the size changed too: not data only
        return entry_from_fd(fd, os.fstat(fd), e.path)

    def save_async(self, text, tokens, tensors, **kwargs):
        """save() on the background writer; returns a concurrent.futures.Future.

        The arrays are captured now: NumPy arrays are copied (the caller may
        reuse its buffers at once), MLX arrays are evaluated on the calling
        thread and handed to the writer as NumPy views of their memory, no
        copy (bfloat16 as its bits, recorded as bfloat16): the writer runs no
        MLX op.  Blocks only while the writer's bounded queue is full.
        """
        self._check_open()
        # Shape checked before the copy: a broadcast view of 2**32 ids costs
        # nothing, its copy 16 GiB.
        tokens = np.array(_token_array(tokens), copy=True)
        captured, dtypes = self.capture(tensors, kwargs.get("dtypes"))
        if dtypes:
            kwargs["dtypes"] = dtypes
        return self.submit(self.save, _as_bytes(text), tokens, captured, **kwargs)

    def capture(self, tensors, dtypes=None):
        """(tensors as the background writer may use them later, the dtypes to
        record): save_async's capture, on the calling thread (see save_async).

        Returns:
            (dict name -> NumPy array, dict name -> recorded dtype or {}).
        """
        captured = {}
        dtypes = dict(dtypes or {})
        # MLX arrays: NumPy views of their memory, made here, on the caller's
        # thread and MLX stream, in one evaluation: the writer then only reads
        # memory (a strided view, a KV buffer cut to its filled length, is
        # copied contiguous by NumPy as it writes).  An MLX op on the writer's
        # thread would queue behind a running prefill (seen: a save of 5.8 MB
        # taking 17-24 s in kvstore serve) and MLX on the CPU is not safe for
        # ops on two threads at once.  A view keeps today's data: an in-place
        # update of the caller's array (cache[..., i:j] = x) cannot reuse a
        # buffer still referenced.
        views = payload.host_views({k: a for k, a in tensors.items() if payload.is_mlx_array(a)})
        for k, a in tensors.items():
            if k in views:
                captured[k], recorded = views[k]
                if recorded is not None:
                    dtypes[k] = recorded
            else:
                captured[k] = np.array(a, copy=True)
        return captured, dtypes

    def submit(self, fn, *args, **kwargs):
        """Runs fn(*args, **kwargs) on the store's background writer, after the
        saves queued before it; returns a concurrent.futures.Future.

        For work that belongs beside a save (naming, checking, then saving
        what capture() took), off the caller's thread.  Blocks only while the
        writer's bounded queue is full.
        """
        self._check_open()
        with self._lock:
            if self._writer is None or self._writer_pid != os.getpid():
                # (A forked child inherits the writer object but not its thread.)
                self._writer = BackgroundWriter()
                self._writer_pid = os.getpid()
        return self._writer.submit(fn, *args, **kwargs)

    def flush(self):
        """Waits for every queued save_async to finish."""
        if self._writer is not None and self._writer_pid == os.getpid():
            self._writer.flush()

    # -- eviction (section 8) ----------------------------------------------

    def evict(self, protect=None, incoming_text=None):
        """Deletes lowest-score checkpoints until the directory fits the budget.

        Runs under the directory's exclusive lock (<dir>/.kvstore.lock) so
        that two evicting processes never delete more than needed and no
        chained save is publishing blocks meanwhile.  Chain blocks go leaves
        first: a block is a candidate only once no stored block continues it,
        so no chain is ever cut in the middle.  Orphaned blocks (whose chain
        does not reach a first block) are removed first.

        Args:
            protect: an Entry never chosen (unless it alone exceeds the budget).
            incoming_text: the text of the checkpoint just written; continued
                waypoints it supersedes score lower.

        Returns:
            the list of evicted entries.
        """
        self._check_open()
        evicted = []
        with self._dir_lock(fcntl.LOCK_EX):
            with self._lock:
                self._index.refresh(force=True)
                orphans = list(self._index.orphans)
                entries = list(self._index.entries.values())
            self._discard_torn()
            victims = evictor.plan(entries, orphans, int(time.time()), self.budget_bytes, max_age_s=self.max_age_s,
                                   protect=protect, superseded=lambda fresh: self._superseded(fresh, protect,
                                                                                             incoming_text),
                                   half_life_s=self.options.hit_half_life_s, stale_after_s=self.options.stale_after_s)
            for v in victims:
                if self._delete(v.entry, v.why):
                    evicted.append(v.entry)
        return evicted

    def _evict_if_over(self, protect, incoming_text=None):
        """evict() after a new file, when the directory as last listed is over the
        budget (or a maximum age applies).  Under the budget the pass is
        skipped: it re-lists and re-reads the whole directory under the
        exclusive lock, which in a directory of 100,000 blocks costs far more
        than the save.  Another process's files count from its next listing;
        its own saves run this check too."""
        with self._lock:
            total = self._index.total_bytes()
        if self.max_age_s is not None or (self.budget_bytes and total > self.budget_bytes):
            self.evict(protect=protect, incoming_text=incoming_text)

    def _sweep_orphans(self):
        """Removes orphaned blocks under the exclusive lock, if it is free now (at
        most every ORPHAN_SWEEP_INTERVAL_S); a lookup never waits for it."""
        now = time.monotonic()
        if now - self._orphans_swept < ORPHAN_SWEEP_INTERVAL_S:
            return
        self._orphans_swept = now
        try:
            with self._dir_lock(fcntl.LOCK_EX | fcntl.LOCK_NB):
                with self._lock:
                    self._index.refresh(force=True)
                    orphans = list(self._index.orphans)
                for e in orphans:
                    self._delete(e, "orphan")
        except (BlockingIOError, KVStoreError):
            pass

    def _superseded(self, entries, incoming, text):
        """Shas of continued waypoints that the incoming checkpoint supersedes."""
        if incoming is None or text is None:
            return frozenset()
        # At least as widely reusable: the incoming checkpoint fits every
        # engine that the waypoint fits.  (A chain's interior blocks may be
        # superseded too; they go only once no block continues them.)
        cands = [e for e in entries
                 if e.reason == Reason.CONTINUED and e.sha and e.text_bytes < len(text)
                 and policy.misfit(incoming, e.model_id, e.ctx_size, e.quant_bits,
                                   self.reject_different_quant, self._abis, self._key_id, e.model_tag) is None]
        if not cands:
            return frozenset()
        out = set()
        for key in {self._key_of(e) for e in cands}:
            mine = [e for e in cands if self._key_of(e) == key]
            digests, _ = names.names_of(text, [e.text_bytes for e in mine], key)
            out.update(e.sha for e, d in zip(mine, digests) if d.hex() == e.sha)
        return frozenset(out)

    def _delete(self, e, why):
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            return False
        with self._lock:
            self._index.discard(e.name)
        self._count(evictions=1, bytes_evicted=e.file_size)
        log.info("kvstore: evicted reason=%s tokens=%d bytes=%d file=%s", why, e.tokens, e.file_size,
                 short_name(e.name))
        return True

    # -- listing, stats, wipe, close ---------------------------------------

    def entries(self):
        """Every valid envelope in the directory (foreign payload ABIs included)."""
        self._check_open()
        with self._lock:
            self._index.refresh()
            return sorted(self._index.entries.values(), key=lambda e: e.name)

    def stats(self):
        """Counters of this process plus the directory's current size.

        "models" lists the models whose files the directory holds
        (kvstore.registry.summarize).  "write_budget" is None without
        max_write_mb_per_hour, else
        {"capacity_bytes", "available_bytes", "rate_bytes_per_s"} (the
        bucket every process on the directory draws from, as this store
        sees it).  The cumulative counters of every process are counters().
        """
        self._check_open()
        with self._lock:
            self._index.refresh()
            out = dict(self._stats)
            out["entries"] = len(self._index.entries)
            out["bytes"] = self._index.total_bytes()
            out["budget_bytes"] = self.budget_bytes
            entries = list(self._index.entries.values())
        # Every model's share of the directory and its one budget (docs/format.md §17).
        out["models"] = registry.summarize(entries, registry.read_registry(self.path))
        out["write_budget"] = (None if self.write_budget_bytes is None
                               else self._counters.report(self.write_budget_bytes)["write_budget"])
        # How a durable save reaches the disk here (docs/format.md §11).
        out["sync"] = files.SYNC_PRIMITIVE if self.durable else "none"
        out["sync_fallbacks"] = files.sync_fallbacks()
        if self.remote is not None:
            out.update(self.remote.stats())
        return out

    def counters(self):
        """The directory's cumulative counters: every process that used it, across restarts.

        Read from ``<dir>/.counters`` (docs/format.md §15); `kvstore stats
        --json` prints the same numbers.  Counting is best-effort: when the
        file cannot be used, this process's own counts.

        Returns:
            a dict: "saves", "bytes_written", "loads", "bytes_read", "hits",
            "misses", "evictions", "bytes_evicted", "corrupt",
            "stores_skipped_write_budget" (ints); "load_seconds" and
            "save_seconds", each {"buckets": [[le, cumulative count], ...]
            (le a float, the last float("inf")), "count": n, "sum_s":
            seconds}; and "write_budget": None, or {"capacity_bytes",
            "available_bytes", "rate_bytes_per_s"} (this store's budget, else
            the one the directory's last budgeted writer recorded).
        """
        self._check_open()
        return self._counters.report(self.write_budget_bytes)

    def wipe(self, entry=None):
        """Overwrites then unlinks one checkpoint, or every checkpoint.

        The text copy in every file is prompt content: wipe overwrites the
        bytes with zeros (and syncs) before unlinking, so a later reader of
        the disk blocks does not find them in freed space.  The directory's
        counters file stays: it is not a checkpoint and holds no prompt text.

        Returns:
            the number of files wiped.
        """
        self._check_open()
        targets = [entry] if entry is not None else self.entries()
        if entry is not None and entry.is_block:
            # The blocks after it could never be loaded again.
            with self._lock:
                self._index.refresh()
                targets += self._index.descendants(entry)
        n = 0
        for e in targets:
            st = files.overwrite(e.path)
            if st is not None and self._unlink_if_same(e.path, st):
                n += 1
        return n

    def close(self):
        """Waits for queued saves and closes the store."""
        if self._closed:
            return
        if self._writer is not None and self._writer_pid == os.getpid():
            self._writer.close()
        if self.remote is not None:
            self.remote.close()
        self._counters.close()
        with self._lock:
            self._index.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _DirLock:
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


# The reasons of tails a longer save of the same sequence replaces (see
# KVStore._drop_replaced_tails): the states kept because a live session
# went away (evicted from RAM, or the server stopped), not anchors,
# waypoints or sessions that the store policy or a person asked for.
_REPLACEABLE = frozenset({Reason.EVICT, Reason.SHUTDOWN})


def _as_sealed(plain, st):
    """The Entry of a sealed file from its authenticated plain copy's (same
    header fields; the sealed ABI and size)."""
    return dataclasses.replace(plain, payload_abi=plain.payload_abi + SEALED_ABI_OFFSET, file_size=st.st_size)


def _check_axes(positional, tensors, n):
    """positional as {name: axis}, checked: each a tensor holding n rows along axis."""
    if not positional:
        return {}
    out = {}
    for name, axis in dict(positional).items():
        if name not in tensors:
            raise ValueError(f"positional names tensor {name!r}, which is not among the tensors")
        shape = tuple(int(d) for d in tensors[name].shape)
        if type(axis) is not int or not 0 <= axis < len(shape) or shape[axis] != n:
            raise ValueError(f"positional[{name!r}]={axis!r}: the tensor's shape {shape} does not hold "
                             f"{n} tokens along that axis")
        out[name] = axis
    return out


def _token_array(tokens):
    """tokens as a 1-D array (no copy) of fewer than 2**32 ids, or ValueError."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size >= 2**32:
        raise ValueError(f"tokens must be a 1-D sequence of < 2**32 ids, got shape {tokens.shape}")
    return tokens
