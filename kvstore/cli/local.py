"""The local commands: ls, inspect, verify, evict, stats, wipe, session list, export, import, key new.

Sealed checkpoints (docs/format.md §16): the commands that open a store or
authenticate files take the key from --key FILE or the KVSTORE_KEY_FILE
environment variable; without it, sealed files are listed as foreign.

A chained checkpoint (docs/format.md §14) is many block files: `ls` folds
them into one row per stored sequence (a save's last block, or a leaf) and
`ls --blocks` shows every file with its parent and range.

The listing commands (ls, inspect, stats, session list, verify without
--quarantine, evict --dry-run) never write to the directory: they read the
envelopes themselves (kvstore.files.scan_directory) instead of opening a
KVStore, whose constructor evicts down to its budget and removes stale
temporary files.  The rules stay where they live: the eviction order in
kvstore.policy, the file checks in kvstore.files, sessions in
kvstore.sessions.

The prompt text in each file is prompt content (docs/format.md §12): only
`inspect --text` prints it.
"""

import collections
import json
import math
import os
import sys
import time

from kvstore import _native, counters, evictor, files, identity, policy, registry, seal, sessions, trailers
from kvstore import remote
from kvstore.cli import text
from kvstore.cli.remote import cmd_remote_ls
from kvstore.cli.text import PROG, UsageError
from kvstore.errors import CheckpointMissing, CorruptCheckpoint, KVStoreError, UnsafePath
from kvstore.index import DirectoryIndex
from kvstore.files import QUARANTINE_DIR, BrokenChain, ancestors, checkpoint_names, describe_error, scan_directory
from kvstore.format import SEALED_ABI_OFFSET, ExtFlag, entry_from_fd, open_checkpoint, read_entry
from kvstore.payload import pread, read_manifest
from kvstore.chain import DEFAULT_BLOCK_TOKENS
from kvstore.exchange import export_checkpoint, file_model, import_checkpoint
from kvstore.store import DEFAULT_BUDGET_MB, LAYOUTS, KVStore


KEY_ENV = "KVSTORE_KEY_FILE"


def _key_file(args):
    """The key file of a command: --key FILE, else $KVSTORE_KEY_FILE, else None."""
    return getattr(args, "key", None) or os.environ.get(KEY_ENV) or None


def _sealer(args):
    """A kvstore.seal.Sealer for the command's key file, or None; a bad key file is a usage error."""
    path = _key_file(args)
    if path is None:
        return None
    try:
        return seal.Sealer(path)
    except (ValueError, OSError, ImportError) as e:
        raise UsageError(f"key: {e}") from None


def _directory(path):
    """The directory argument, checked: UsageError if it is not an existing directory."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise UsageError(f"{path}: not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{path}: permission denied")
    return path


def _match(names, prefix, where):
    """The one name starting with a hex prefix (4+ digits); UsageError otherwise."""
    p = prefix.lower()
    if not (sessions.MIN_PREFIX <= len(p) <= 40 and all(c in "0123456789abcdef" for c in p)):
        raise UsageError(f"{prefix!r} is not a file and not a hash prefix "
                         f"({sessions.MIN_PREFIX} to 40 hex digits)")
    found = sorted(n for n in names if n.lower().startswith(p))
    if not found:
        raise UsageError(f"no checkpoint in {where} starts with {p!r}")
    if len(found) > 1:
        raise UsageError(f"prefix {p!r} is ambiguous in {where}: it matches "
                         + ", ".join(n[:12] for n in found[:8])
                         + (f" and {len(found) - 8} more" if len(found) > 8 else "")
                         + "; give more digits")
    return found[0]


def _rank(entries, now):
    """(score, entry), the best kept first: eviction's own order, reversed (the next victim last)."""
    order = policy.eviction_order(entries, now, stale_after_s=policy.DEFAULT_STALE_AFTER_S)
    return [(policy.eviction_score(e, now), e) for e in reversed(order)]


# ---- commands -----------------------------------------------------------------

def _chains(entries):
    """(sequences, chain of each entry): the rows `ls` folds blocks into.

    A sequence is a whole file, the last block of a save, or a block no
    other block continues; its chain is its blocks in the directory, first
    block first (as far as the parents are there).
    """
    by_sha = {e.sha: e for e in entries if e.sha}
    parents = {e.parent for e in entries if e.is_block and e.parent}

    def chain(e):
        out = [e]
        while out[-1].is_block and out[-1].parent in by_sha and len(out) <= len(entries):
            out.append(by_sha[out[-1].parent])
        return out[::-1]
    seqs = [e for e in entries if e.ends_save or (e.is_block and e.sha not in parents)]
    return seqs, {e.name: chain(e) for e in seqs}


def _block_range(e):
    return f"{e.token_start}..{e.tokens}" if e.is_block else f"0..{e.tokens}"


def cmd_ls(args):
    if args.remote:
        if args.dir is not None:
            raise UsageError("ls takes DIR or --remote, not both")
        return cmd_remote_ls(args)
    if args.dir is None:
        raise UsageError("ls needs DIR (or --remote s3://BUCKET/PREFIX)")
    d = _directory(args.dir)
    sealer = _sealer(args)
    entries, bad = scan_directory(d)
    now = int(time.time())
    ranked = _rank(entries, now)
    blocks = [e for e in entries if e.is_block]
    seqs, chains = _chains(entries)
    if not args.blocks:
        shown = {e.name for e in seqs}
        ranked = [(score, e) for score, e in ranked if e.name in shown]
    titles = {e.name: sessions.read_title(e, sealer) for _, e in ranked}
    models = registry.read_registry(d)

    def model(e):
        # A file that names its model shows the model; one that names none, its header model id.
        return registry.describe_tag(e.model_tag, models) if e.model_tag else e.model_id
    if args.json:
        out = []
        for score, e in ranked:
            row = {
                "sha": e.sha, "prefix": e.sha[:12], "reason": text.reason_name(e.reason),
                "tokens": e.tokens, "hits": e.hits, "ctx_size": e.ctx_size, "quant_bits": e.quant_bits,
                "model_id": e.model_id, "model": registry.describe_tag(e.model_tag, models),
                "model_tag": identity.tag_hex(e.model_tag), "payload_abi": e.payload_abi,
                "loadable": e.loadable or (sealer is not None and sealer.owns(e)),
                "sealed": e.sealed,
                "file_size": e.file_size, "created_at": e.created_at, "last_used": e.last_used,
                "age_s": max(0, now - e.created_at) if e.created_at else None,
                "idle_s": max(0, now - e.last_used) if e.last_used else None,
                "title": titles[e.name], "score": score,
            }
            if e.is_block:
                row.update(parent=e.parent or None, token_start=e.token_start, text_start=e.text_start,
                           restorable=e.restorable, ends_save=e.ends_save)
            if not args.blocks and e.name in chains:
                row.update(blocks=len(chains[e.name]) if e.is_block else 0,
                           chain_bytes=sum(b.file_size for b in chains[e.name]))
            out.append(row)
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    budget = text.mib_bytes(args.budget_mb)
    if ranked and args.blocks:
        rows = [(e.sha[:12], text.reason_name(e.reason), _block_range(e), e.parent[:12] if e.parent else "-",
                 "yes" if e.restorable else "link", e.hits, text.abi(e), text.size(e.file_size),
                 text.age(e.created_at, now), text.used(e, now), text.printable(titles[e.name], text.TITLE_COLUMN))
                for _, e in ranked]
        print(text.table(rows, ("SHA", "REASON", "TOKENS", "PARENT", "LOADS", "HITS", "ABI", "SIZE", "AGE",
                                "USED", "TITLE"), right={5, 7}))
    elif ranked:
        # A BLOCKS column where chains are (a directory of whole files keeps
        # the table it always had).
        rows = [(e.sha[:12], text.reason_name(e.reason), e.tokens)
                + ((len(chains[e.name]) if e.is_block else "whole",) if blocks else ())
                + (e.hits, e.ctx_size, e.quant_bits, model(e), text.abi(e),
                   text.size(sum(b.file_size for b in chains[e.name])), text.age(e.created_at, now),
                   text.used(e, now), text.printable(titles[e.name], text.TITLE_COLUMN))
                for _, e in ranked]
        head = ("SHA", "REASON", "TOKENS") + (("BLOCKS",) if blocks else ()) + (
            "HITS", "CTX", "QUANT", "MODEL", "ABI", "SIZE", "AGE", "USED", "TITLE")
        print(text.table(rows, head, right={i for i, h in enumerate(head)
                                            if h in ("TOKENS", "BLOCKS", "HITS", "CTX", "QUANT", "SIZE")}))
    else:
        print(f"no checkpoints in {d}")
    total = sum(e.file_size for e in entries)
    ours = sum(1 for e in entries if sealer is not None and sealer.owns(e))
    foreign = sum(1 for e in entries if not e.loadable) - ours
    if blocks:
        print(f"{text.plural(len(seqs), 'stored sequence')} in {text.plural(len(entries), 'file')} "
              f"({text.plural(len(blocks), 'chain block')}), {text.budget_line(total, budget)}")
    else:
        print(f"{len(entries)} checkpoint{'s' if len(entries) != 1 else ''}, {text.budget_line(total, budget)}")
    if ours:
        print(f"{ours} sealed with this key")
    if foreign:
        print(f"{foreign} with a foreign payload ABI (or sealed with another key): listed and counted in the "
              "budget, not loadable")
    if bad:
        print(f"{len(bad)} file{'s' if len(bad) != 1 else ''} with a bad envelope "
              f"(not counted; see `kvstore verify`)")
    return 0


def _inspect_target(args):
    target = args.target
    if os.path.lexists(target):
        if os.path.isdir(target):
            raise UsageError(f"{target}: is a directory (give a .kv file or a hash prefix)")
        return target
    if os.sep in target or target.endswith(".kv"):
        raise UsageError(f"{target}: no such file")
    d = _directory(args.dir)
    return os.path.join(d, _match(checkpoint_names(d), target, d))


def cmd_inspect(args):
    path = _inspect_target(args)
    now = int(time.time())
    try:
        fd, st = open_checkpoint(path)
    except CheckpointMissing:
        raise UsageError(f"{path}: no such file") from None
    except UnsafePath:
        raise UsageError(f"{path}: not a regular file (kvstore never follows symlinks)") from None
    status = 0
    try:
        try:
            e = entry_from_fd(fd, st, path)
        except CorruptCheckpoint as err:
            print(f"{PROG}: error: {os.path.basename(path)}: corrupt envelope: {describe_error(err)}",
                  file=sys.stderr)
            return 1
        flags = text.flag_names(e.ext_flags)
        rows = [
            ("file", path),
            ("sha", e.sha or "-  (the file name is not 40 hex + .kv)"),
            ("version", 1),
            ("quant bits", e.quant_bits),
            ("reason", f"{text.reason_name(e.reason)} ({int(e.reason)})"),
            ("ext flags", f"0x{int(e.ext_flags):02x}" + (f" ({', '.join(flags)})" if flags else "")),
            ("model id", e.model_id),
            ("model", "- (names no model)" if not e.model_tag else
             f"{registry.describe_tag(e.model_tag, registry.read_registry(os.path.dirname(path)))} "
             f"(tag {identity.tag_hex(e.model_tag)})"),
            ("tokens", e.tokens),
            ("hits", e.hits),
            ("ctx size", e.ctx_size),
            ("payload abi", f"{e.payload_abi} (loadable)" if e.loadable
             else f"{e.payload_abi} (sealed {e.payload_abi - SEALED_ABI_OFFSET})" if e.sealed
             else f"{e.payload_abi} (foreign: listed and counted, not loadable by this build)"),
            ("created", text.stamp(e.created_at, now)),
            ("last used", text.stamp(e.last_used, now) if e.last_used else "never"),
            ("text", f"{e.text_bytes} bytes" if not e.is_block
             else f"{e.segment_bytes} bytes stored ({e.text_start}..{e.text_bytes} of the sequence)"),
            ("payload", f"{e.payload_bytes} bytes"),
            ("trailer", f"{e.file_size - e.trailer_offset} bytes"),
            ("file size", f"{e.file_size} bytes ({text.size(e.file_size)})"),
        ]
        if e.is_block:
            rows += _block_rows(e, os.path.dirname(path))
        # A sealed file shows its manifest, trailers and text through its key.
        sealer = _sealer(args)
        src, plain, why = fd, e, None
        if e.sealed:
            if sealer is None or not sealer.owns(e):
                why = "no key given" if sealer is None else "sealed with another key"
                rows.append(("sealed", f"key id {e.key_id.hex()} ({why}: text, manifest and trailers hidden)"))
            else:
                try:
                    src, plain = sealer.source(fd, st, e)
                except CorruptCheckpoint as err:
                    why = f"does not authenticate: {describe_error(err)}"
                    status = 1
                rows.append(("sealed", f"key id {e.key_id.hex()} (this key; " + (why or "heads authenticated") + ")"))
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k.ljust(w)}  {v}")
        if why is not None:
            if args.text:
                raise UsageError(f"{e.name[:12]} is sealed: give its key (--key FILE or ${KEY_ENV})")
            return status
        if plain.loadable:
            try:
                m = read_manifest(src, plain)
            except CorruptCheckpoint as err:
                print(f"manifest: corrupt ({describe_error(err)})")
                status = 1
            else:
                print("manifest:")
                print(f"  tokens: count={plain.stored_tokens} bytes={4 * plain.stored_tokens} "
                      f"offset={m.tokens[0]} crc32c=0x{m.tokens[2]:08x}" + (" (sealed: the tags check)"
                                                                          if e.sealed else ""))
                trows = [(text.printable(name), dtype, "(" + ", ".join(str(x) for x in shape)
                          + ("," if len(shape) == 1 else "") + ")", n,
                          f"axis {m.axes[name]}" if name in m.axes else "snapshot")
                         for name, dtype, shape, _, n, _ in m.tensors]
                print(f"  tensors ({len(trows)}):")
                if trows:
                    print("\n".join("    " + line for line in
                                    text.table(trows, ("NAME", "DTYPE", "SHAPE", "BYTES", "KIND"),
                                               right={3}).split("\n")))
                print(f"  meta keys: {', '.join(text.printable(k) for k in sorted(m.meta)) or '-'}")
                if m.model is not None:
                    print(f"  model: {text.printable(m.model)}")
        sections = list(trailers.trailer_sections(src, plain))
        print(f"trailer sections ({len(sections)}):")
        for bit, off, length, crc in sections:
            name = ExtFlag(1 << bit).name.lower().replace("_", "-") if bit < 4 else "unknown"
            got = files.crc_range(fd, off, length, path) if src is fd else _native.crc32c(pread(src, length, off))
            print(f"  bit {bit} ({name})  length {length}  crc {'ok' if got == crc else 'BAD (dropped on load)'}")
        title = sessions.read_title(e, sealer)
        if title is not None:
            print(f"title: {text.printable(title)}")
        if args.text:
            print("text:")
            sys.stdout.flush()
            _copy_text(src, plain, sys.stdout.buffer, os.path.dirname(path), sealer)
            sys.stdout.buffer.write(b"\n")
            sys.stdout.buffer.flush()
    finally:
        os.close(fd)
    return status


def _block_rows(e, d):
    """inspect's rows for a chain block: its range, its parent, its chain in d."""
    chain, complete = [e], True
    try:
        for parent in ancestors(e, d, linked=False):
            chain.append(parent)
    except BrokenChain:
        complete = False
    return [
        ("block", f"tokens {e.token_start}..{e.tokens} of the sequence, grid {e.block_grid}"),
        ("parent", e.parent or "none (the first block)"),
        ("restorable", "yes: loads with its chain" if e.restorable
         else "no: a link (the state's snapshots are in a later block)"),
        ("ends a save", "yes" if e.ends_save else "no"),
        ("chain", f"{text.plural(len(chain), 'block')}, {text.size(sum(b.file_size for b in chain))}"
         + ("" if complete else f"; BROKEN: parent {chain[-1].parent[:12]} is missing or unreadable")),
    ]


def _copy_text(fd, e, out, d, sealer=None, chunk=1 << 20):
    """Writes the stored prompt text to out, a bounded chunk at a time; for a
    chain block, its whole sequence's text (its parents' segments first).
    fd may be a sealed file's plain view (e its plain Entry); sealer reads
    its sealed parents."""
    try:
        parts = list(ancestors(e, d, linked=False))
    except BrokenChain as broken:
        raise UsageError(f"{e.name}: parent {broken.name[:12]} is missing: the text before "
                         f"byte {broken.child.text_start} is not here") from None
    for p in reversed(parts):
        pfd, pst = open_checkpoint(p.path)
        try:
            if p.sealed:
                if sealer is None:
                    raise UsageError(f"{e.name}: parent {p.name[:12]} is sealed: give its key")
                try:
                    src, plain = sealer.source(pfd, pst, p)
                except CorruptCheckpoint as err:
                    raise UsageError(f"{e.name}: parent {p.name[:12]}: {describe_error(err)}") from None
                _copy_segment(src, plain, out, chunk)
            else:
                _copy_segment(pfd, p, out, chunk)
        finally:
            os.close(pfd)
    _copy_segment(fd, e, out, chunk)


def _copy_segment(fd, e, out, chunk):
    for off in range(0, e.segment_bytes, chunk):
        data = pread(fd, min(chunk, e.segment_bytes - off), e.text_offset + off)
        if not data:
            break
        out.write(data)


def cmd_verify(args):
    d = _directory(args.dir)
    sealer = _sealer(args)
    names = checkpoint_names(d)
    sizes = {}
    for name in names:
        try:
            sizes[name] = os.lstat(os.path.join(d, name)).st_size
        except FileNotFoundError:
            pass
    show = args.progress or sys.stderr.isatty()
    bar = text.Progress(sum(sizes.values()), "verify", show)
    checked = ok = foreign = 0
    bad = []
    moved = 0
    done = 0
    for name in names:
        if name not in sizes:
            continue
        bar.reach(done)
        done += sizes[name]
        path = os.path.join(d, name)
        try:
            before = os.lstat(path)
            try:
                e = read_entry(path)
            except CheckpointMissing:
                raise
            except (KVStoreError, OSError) as err:
                reason = describe_error(err)
            else:
                ours = sealer is not None and sealer.owns(e)
                if ours:
                    reason = sealer.verify_file(path, bar.advance)
                else:
                    reason = None if not e.loadable else files.verify_file(path, bar.advance)
        except (CheckpointMissing, FileNotFoundError):
            continue                    # deleted while we checked: nothing to verify
        checked += 1
        bar.files = checked
        if reason is None:
            if e.loadable or ours:
                ok += 1
            else:
                foreign += 1
            continue
        bad.append(name)
        note = ""
        if args.quarantine:
            done, what = _quarantine(d, path, before)
            moved += done
            note = f"  ({what})"
        bar.clear()
        print(f"{name}: {reason}{note}", flush=True)
    bar.close()
    parts = [f"{ok} ok"]
    if foreign:
        parts.append(f"{foreign} foreign payload ABI (envelope only)")
    parts.append(f"{len(bad)} corrupt")
    print(f"verified {checked} file{'s' if checked != 1 else ''} in {d}: " + ", ".join(parts))
    if args.quarantine and bad:
        print(f"moved {moved} to {os.path.join(d, QUARANTINE_DIR)}")
    return 1 if bad else 0


def _quarantine(d, path, before):
    """Moves a bad file aside, unless it was replaced since it was checked.

    Returns:
        (moved, what happened in a few words).
    """
    try:
        if not files.same_file(path, before):
            if not os.path.lexists(path):
                return False, "gone meanwhile"
            return False, "kept: replaced while it was checked"
        files.quarantine(path, d)               # never into a planted symlink
    except FileNotFoundError:
        return False, "gone meanwhile"
    except OSError as e:
        return False, f"kept: {os.strerror(e.errno) if e.errno else e}"
    return True, f"moved to {QUARANTINE_DIR}/"


def _model_of_file(d, e, sealer):
    """The model identity of a file that names one (docs/format.md §17): the
    directory's registry's, else its manifest's (through the key when sealed);
    None for a file that names none."""
    if not e.model_tag:
        return None
    row = registry.read_registry(d).get(e.model_tag)
    if row is not None:
        return row["identity"]
    if not e.sealed:
        return file_model(e.path)
    if sealer is None or not sealer.owns(e):
        return None
    fd, st = open_checkpoint(e.path)
    try:
        src, plain = sealer.source(fd, st, e)
        return read_manifest(src, plain).model
    except CorruptCheckpoint:
        return None
    finally:
        os.close(fd)


def _open_store(d, key=None, **kw):
    """A KVStore over d that evicts nothing on open (budget 0 = unlimited)."""
    try:
        return KVStore(d, budget_mb=0, key=key, **kw)
    except UnsafePath:
        raise UsageError(f"{d}: not a directory (kvstore never follows symlinks)") from None


def cmd_evict(args):
    d = _directory(args.dir)
    if args.budget_mb <= 0:
        raise UsageError("evict --budget-mb must be > 0 (to remove every checkpoint use `kvstore wipe`)")
    budget = text.mib_bytes(args.budget_mb)
    # KVStore.evict's plan (kvstore.evictor): the dry run prints it, the
    # real run carries it out; the same victims in the same order, orphans
    # first.  The index here is read only (no journal is created).
    index = DirectoryIndex(d, journal=False)
    index.refresh(force=True)
    before = index.total_bytes()
    now = int(time.time())
    if args.dry_run:
        victims = [v.entry for v in evictor.plan(list(index.entries.values()), index.orphans, now, budget)]
        total = before - sum(v.file_size for v in victims)
        verb = "would evict"
    else:
        orphans = index.orphans
        store = _open_store(d)          # its open removes the orphans
        # Opened with no budget so that the constructor deletes nothing else;
        # the explicit pass below evicts to the given one and reports its victims.
        store.budget_bytes = budget
        try:
            victims = [o for o in orphans if not os.path.lexists(o.path)] + store.evict()
            total = store.stats()["bytes"]
        finally:
            store.close()
        verb = "evicted"
    for v in victims:
        print(f"{verb} {v.sha[:12] or v.name}  {text.reason_name(v.reason)}  tokens {v.tokens}  "
              f"hits {v.hits}  {text.size(v.file_size)}")
    freed = sum(v.file_size for v in victims)
    print(f"{verb} {len(victims)} checkpoint{'s' if len(victims) != 1 else ''} ({text.size(freed)}); "
          f"{'would leave' if args.dry_run else 'now'} {text.budget_line(total, budget)}"
          f" (was {text.size(before)})")
    return 0


def cmd_stats(args):
    d = _directory(args.dir)
    entries, bad = scan_directory(d)
    now = int(time.time())
    budget = text.mib_bytes(args.budget_mb)
    total = sum(e.file_size for e in entries)
    by_reason = collections.Counter(text.reason_name(e.reason) for e in entries)
    times = [e.created_at for e in entries if e.created_at]
    out = {
        "dir": os.path.abspath(d),
        "entries": len(entries),
        "bytes": total,
        "budget_bytes": budget,
        "budget_use": (total / budget) if budget else None,
        "by_reason": {r: by_reason[r] for r in sorted(by_reason)},
        "hits": sum(e.hits for e in entries),
        "tokens": sum(e.tokens for e in entries),
        "not_loadable": sum(1 for e in entries if not e.loadable),
        "bad_envelopes": len(bad),
        "oldest": min(times) if times else None,
        "newest": max(times) if times else None,
        "sync": files.SYNC_PRIMITIVE,
        # Every model's share of the directory (docs/format.md §17).
        "models": registry.summarize(entries, registry.read_registry(d)),
        # Every process's cumulative counters (KVStore.counters()), read
        # without creating or changing the file.
        "directory": counters.read_directory(d),
    }
    if args.json:
        print(json.dumps(dict(out, directory=_json_counters(out["directory"])), indent=2))
        return 0
    rows = [
        ("entries", f"{out['entries']}" + (f" ({out['not_loadable']} with a foreign payload ABI)"
                                           if out["not_loadable"] else "")),
        ("bytes", text.budget_line(total, budget)),
        ("by reason", ", ".join(f"{r} {n}" for r, n in out["by_reason"].items()) or "-"),
        ("hits", out["hits"]),
        ("tokens", out["tokens"]),
        ("models", "; ".join(f"{m['name']} ({m['tag']}): {text.plural(m['entries'], 'file')}, "
                             f"{text.size(m['bytes'])}" for m in out["models"]) or "-"),
        ("oldest", text.stamp(out["oldest"], now)),
        ("newest", text.stamp(out["newest"], now)),
        ("sync", f"{out['sync']} (what a durable save calls on this platform)"),
    ]
    if bad:
        rows.append(("bad envelopes", f"{len(bad)} (see `kvstore verify`)"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")
    c = out["directory"]
    budget = c["write_budget"]
    rows = [
        ("saves", c["saves"]),
        ("bytes written", text.size(c["bytes_written"])),
        ("loads", c["loads"]),
        ("bytes read", text.size(c["bytes_read"])),
        ("evictions", f"{c['evictions']} ({text.size(c['bytes_evicted'])})"),
        ("corrupt", c["corrupt"]),
        ("canary", f"{c['canary_checks']} restores checked, {c['canary_failures']} failed (quarantined)"),
        ("skipped (write budget)", c["stores_skipped_write_budget"]),
        ("write budget", "none" if budget is None else
         f"{text.size(budget['available_bytes'])} of {text.size(budget['capacity_bytes'])} available, "
         f"refills {text.size(budget['capacity_bytes'])} an hour"),
    ]
    print("directory counters (every process, cumulative):")
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(w)}  {v}")
    return 0


def _json_counters(c):
    """The directory counters for JSON, which has no infinity: the last bucket's bound as "+Inf"."""
    out = dict(c)
    for h in counters.HISTOGRAMS:
        out[h] = dict(c[h], buckets=[["+Inf" if le == math.inf else le, n] for le, n in c[h]["buckets"]])
    return out


def cmd_wipe(args):
    """Valid checkpoints go through KVStore.wipe; a full wipe also takes the
    files that hold prompt text without being valid checkpoints (a bad
    envelope, the quarantine), since wiping is about that text."""
    d = _directory(args.dir)
    names = checkpoint_names(d)
    qdir = os.path.join(d, QUARANTINE_DIR)
    quarantined = []
    if args.prefix is not None:
        targets = [os.path.join(d, _match(names, args.prefix, d))]
        what = f"checkpoint {os.path.basename(targets[0])[:12]}"
    else:
        targets = [os.path.join(d, n) for n in names]
        if os.path.isdir(qdir) and not os.path.islink(qdir):
            quarantined = [os.path.join(qdir, n) for n in checkpoint_names(qdir)]
        what = f"all {len(targets)} checkpoint file{'s' if len(targets) != 1 else ''}"
        if quarantined:
            what += f" and {len(quarantined)} in {QUARANTINE_DIR}"
    if not args.yes:
        raise UsageError(f"wipe overwrites and deletes {what} in {d}; add --yes to confirm")
    store = _open_store(d)
    try:
        valid = {e.name: e for e in store.entries()}
        n = 0
        for path in targets:
            e = valid.get(os.path.basename(path))
            n += store.wipe(e) if e is not None else files.wipe_file(path)
    finally:
        store.close()
    q = sum(files.wipe_file(path) for path in quarantined)
    print(f"wiped {n} checkpoint file{'s' if n != 1 else ''} in {d}"
          + (f" and {q} in {QUARANTINE_DIR}" if quarantined else ""))
    return 0


def cmd_export(args):
    d = _directory(args.dir)
    name = _match(checkpoint_names(d), args.target, d)
    try:
        e = read_entry(os.path.join(d, name))
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {name}: corrupt envelope: {describe_error(err)}", file=sys.stderr)
        return 1
    if os.path.isdir(args.file):
        raise UsageError(f"{args.file}: is a directory (give the file to write)")
    # A model id of the file's own: export reads any model's checkpoint.
    key = _key_file(args)
    if key is not None:
        _sealer(args)                    # a bad key file is a usage error
    if e.sealed and key is None:
        raise UsageError(f"{name[:12]} is sealed: give its key (--key FILE or ${KEY_ENV})")
    if e.sealed and not args.plain:
        raise UsageError("an export is one plain .kv file: the prompt text and its KV state in the clear; "
                         "pass --plain to write it anyway")
    store = _open_store(d, key=key, model_id=e.model_id, quant_bits=e.quant_bits,
                        model_identity=_model_of_file(d, e, _sealer(args)))
    try:
        out = export_checkpoint(store, e, args.file, plain=args.plain)
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {name}: {describe_error(err)}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(f"exported {name[:12]} ({e.tokens} tokens, {text.size(out.file_size)}) to {args.file}")
    return 0


def cmd_import(args):
    if not os.path.isfile(args.file):
        raise UsageError(f"{args.file}: no such file")
    if args.block_tokens < 1:
        raise UsageError(f"--block-tokens {args.block_tokens} must be >= 1")
    try:
        e = read_entry(args.file)
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {args.file}: corrupt envelope: {describe_error(err)}", file=sys.stderr)
        return 1
    try:
        key = _key_file(args)
        if key is not None:
            _sealer(args)
        store = KVStore(args.dir, budget_mb=args.budget_mb, model_id=e.model_id, quant_bits=e.quant_bits,
                        layout=args.layout, block_tokens=args.block_tokens, key=key,
                        model_identity=file_model(args.file) if e.model_tag else None)
    except UnsafePath:
        raise UsageError(f"{args.dir}: not a directory (kvstore never follows symlinks)") from None
    try:
        got = import_checkpoint(store, args.file)
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {args.file}: {describe_error(err)}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if got is None:
        print(f"{PROG}: error: {args.file}: not stored (over the {text.size(text.mib_bytes(args.budget_mb))} "
              "budget; see --budget-mb)", file=sys.stderr)
        return 1
    print(f"imported {e.tokens} tokens as {got.name[:12]} in {args.dir}")
    return 0


def cmd_session_list(args):
    d = _directory(args.dir)
    found = sessions.from_entries(scan_directory(d)[0], _sealer(args))
    now = int(time.time())
    if args.json:
        print(json.dumps([{
            "sha": s.sha, "prefix": s.prefix, "title": s.title, "tokens": s.tokens, "hits": s.hits,
            "created_at": s.created_at, "last_used": s.last_used, "model_id": s.model_id,
            "file_size": s.file_size,
        } for s in found], indent=2, ensure_ascii=False))
        return 0
    if not found:
        print(f"no agent sessions in {d}")
        return 0
    rows = [(s.prefix, text.printable(s.title, text.TITLE_COLUMN) or "-", s.tokens, s.hits,
             "never" if not s.last_used else text.span(now - s.last_used) + " ago",
             text.age(s.created_at, now)) for s in found]
    print(text.table(rows, ("SHA", "TITLE", "TOKENS", "HITS", "USED", "AGE"), right={2, 3}))
    return 0


def cmd_key_new(args):
    try:
        seal.new_key_file(args.file)
    except FileExistsError:
        raise UsageError(f"{args.file}: exists; a key is never overwritten (the files it sealed would be lost)") \
            from None
    except ImportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote a new 32-byte key to {args.file} (mode 0600); keep a copy: files sealed with it "
          "cannot be read without it")
    return 0


def _add_key(s):
    s.add_argument("--key", metavar="FILE", help=f"the store key of sealed checkpoints (default: ${KEY_ENV})")


def add_parsers(sub):
    """The local commands' subparsers."""
    s = sub.add_parser("ls", help="list checkpoints, best kept first (or a bucket's, with --remote)")
    s.add_argument("dir", metavar="DIR", nargs="?")
    s.add_argument("--json", action="store_true", help="a JSON list of objects")
    s.add_argument("--budget-mb", type=text.megabytes, default=DEFAULT_BUDGET_MB,
                   help=f"budget shown against the total (default {DEFAULT_BUDGET_MB}; 0: none)")
    s.add_argument("--blocks", action="store_true", help="one row per chain block (parent, range), not per sequence")
    remote.add_arguments(s)
    _add_key(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", help="show one checkpoint's header, manifest and trailer")
    s.add_argument("target", metavar="FILE|SHA-PREFIX")
    s.add_argument("--dir", default=".", help="directory to search for a hash prefix (default: .)")
    s.add_argument("--text", action="store_true", help="also print the stored prompt text")
    _add_key(s)
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="check every envelope and payload CRC")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--quarantine", action="store_true", help=f"move bad files to DIR/{QUARANTINE_DIR}")
    s.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    _add_key(s)
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("evict", help="delete lowest-score checkpoints until DIR fits a budget")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--budget-mb", type=text.megabytes, required=True)
    s.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    s.set_defaults(func=cmd_evict)

    s = sub.add_parser("stats", help="totals: entries, bytes, reasons, hits, ages; the directory's cumulative counters")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true")
    s.add_argument("--budget-mb", type=text.megabytes, default=DEFAULT_BUDGET_MB)
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("wipe", help="overwrite then delete one checkpoint, or all")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("prefix", metavar="SHA-PREFIX", nargs="?")
    s.add_argument("--yes", action="store_true", help="really do it")
    s.set_defaults(func=cmd_wipe)

    s = sub.add_parser("export", help="write one stored sequence (a chain, or a whole file) as one .kv file")
    s.add_argument("target", metavar="SHA-PREFIX")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--dir", default=".", help="the cache directory (default: .)")
    s.add_argument("--plain", action="store_true",
                   help="export a sealed checkpoint anyway: the file holds the prompt in the clear")
    _add_key(s)
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("import", help="store a .kv file (from export) in a cache directory")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--dir", required=True, help="the cache directory (created if missing)")
    s.add_argument("--layout", choices=LAYOUTS, default="chain", help="how to store it (default: chain)")
    s.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"chain grid (default {DEFAULT_BLOCK_TOKENS})")
    s.add_argument("--budget-mb", type=text.megabytes, default=DEFAULT_BUDGET_MB)
    _add_key(s)
    s.set_defaults(func=cmd_import)

    s = sub.add_parser("session", help="agent sessions")
    ss = s.add_subparsers(dest="session_command", metavar="SUBCOMMAND", required=True)
    s = ss.add_parser("list", help="saved agent sessions, newest first")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true")
    _add_key(s)
    s.set_defaults(func=cmd_session_list)

    s = sub.add_parser("key", help="store keys of sealed checkpoints")
    ks = s.add_subparsers(dest="key_command", metavar="SUBCOMMAND", required=True)
    s = ks.add_parser("new", help="write a fresh random 32-byte key to FILE (0600); never overwrites")
    s.add_argument("file", metavar="FILE")
    s.set_defaults(func=cmd_key_new)
