"""`kvstore inspect`: one checkpoint's header, chain, manifest, trailer and (asked for) text.

The prompt text in each file is prompt content (docs/semantics.md §12): only
`inspect --text` prints it.  A sealed file shows its manifest, trailers and
text through its key, and only its clear head without one.
"""

import os
import sys
import time

from kvstore import _native, ds4, files, identity, registry, sessions, trailers
from kvstore.cli import keys, text
from kvstore.cli.local import directory, match
from kvstore.cli.text import PROG, UsageError
from kvstore.errors import CheckpointMissing, CorruptCheckpoint, UnsafePath
from kvstore.files import BrokenChain, ancestors, checkpoint_names, describe_error
from kvstore.format import SEALED_ABI_OFFSET, ExtFlag, entry_from_fd, open_checkpoint
from kvstore.payload import pread, read_manifest

# --text copies the stored text to stdout this many bytes at a time.
TEXT_CHUNK = 1 << 20


def inspect_target(args):
    """The file to inspect: the argument itself, else the one name in --dir it is a hash prefix of."""
    target = args.target
    if os.path.lexists(target):
        if os.path.isdir(target):
            raise UsageError(f"{target}: is a directory (give a .kv file or a hash prefix)")
        return target
    if os.sep in target or target.endswith(".kv"):
        raise UsageError(f"{target}: no such file")
    d = directory(args.dir)
    return os.path.join(d, match(checkpoint_names(d), target, d))


def header_rows(e, path, now):
    """(label, value) of every header field of the file at path."""
    flags = text.flag_names(e.ext_flags)
    return [
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
         else f"{e.payload_abi} (ds4's graph state: listed and counted, not loadable here)" if ds4.is_ds4(e)
         else f"{e.payload_abi} (foreign: listed and counted, not loadable by this build)"),
        ("created", text.stamp(e.created_at, now)),
        ("last used", text.stamp(e.last_used, now) if e.last_used else "never"),
        ("text", f"{e.text_bytes} bytes" if not e.is_block
         else f"{e.segment_bytes} bytes stored ({e.text_start}..{e.text_bytes} of the sequence)"),
        ("payload", f"{e.payload_bytes} bytes"),
        ("trailer", f"{e.file_size - e.trailer_offset} bytes"),
        ("file size", f"{e.file_size} bytes ({text.size(e.file_size)})"),
    ]


def block_rows(e, d):
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


def unseal(sealer, fd, st, e):
    """A sealed file's plain view through the key.

    Returns:
        (source, plain Entry, why its insides stay hidden or None, exit
        status, the "sealed" row).
    """
    if sealer is None or not sealer.owns(e):
        why = "no key given" if sealer is None else "sealed with another key"
        return fd, e, why, 0, ("sealed", f"key id {e.key_id.hex()} ({why}: text, manifest and trailers hidden)")
    src, plain, why, status = fd, e, None, 0
    try:
        src, plain = sealer.source(fd, st, e)
    except CorruptCheckpoint as err:
        why = f"does not authenticate: {describe_error(err)}"
        status = 1
    return src, plain, why, status, ("sealed", f"key id {e.key_id.hex()} (this key; "
                                               + (why or "heads authenticated") + ")")


def print_manifest(src, plain, sealed):
    """Prints the manifest of a loadable file; returns the exit status (1: corrupt)."""
    try:
        m = read_manifest(src, plain)
    except CorruptCheckpoint as err:
        print(f"manifest: corrupt ({describe_error(err)})")
        return 1
    print("manifest:")
    print(f"  tokens: count={plain.stored_tokens} bytes={4 * plain.stored_tokens} "
          f"offset={m.tokens[0]} crc32c=0x{m.tokens[2]:08x}" + (" (sealed: the tags check)" if sealed else ""))
    trows = [(text.printable(name), dtype, "(" + ", ".join(str(x) for x in shape)
              + ("," if len(shape) == 1 else "") + ")", n, m.packed[name][0] if name in m.packed else n,
              m.packed[name][1].codec if name in m.packed else "raw",
              f"axis {m.axes[name]}" if name in m.axes else "snapshot")
             for name, dtype, shape, _, n, _ in m.tensors]
    print(f"  tensors ({len(trows)}):")
    if trows:
        print("\n".join("    " + line for line in text.table(
            trows, ("NAME", "DTYPE", "SHAPE", "BYTES", "STORED", "CODEC", "KIND"), right={3, 4}).split("\n")))
    print(f"  meta keys: {', '.join(text.printable(k) for k in sorted(m.meta)) or '-'}")
    if m.model is not None:
        print(f"  model: {text.printable(m.model)}")
    return 0


def print_trailers(fd, src, plain, path):
    """Every trailer section's bit, length and whether its CRC checks (a bad one is dropped on load);
    for ds4's unframed tool map, how many entries it holds (never their content)."""
    head = pread(src, len(ds4.KTM_MAGIC), plain.trailer_offset) if plain.file_size > plain.trailer_offset else b""
    if ds4.is_tool_map(head):
        try:
            n = len(ds4.parse_tool_map(pread(src, plain.file_size - plain.trailer_offset, plain.trailer_offset)))
            print(f"trailer: ds4 tool map (KTM v1), {n} entr{'y' if n == 1 else 'ies'}")
        except ValueError as e:
            print(f"trailer: ds4 tool map (KTM v1), unreadable: {e}")
        return
    sections = list(trailers.trailer_sections(src, plain))
    print(f"trailer sections ({len(sections)}):")
    for bit, off, length, crc in sections:
        name = ExtFlag(1 << bit).name.lower().replace("_", "-") if bit < 4 else "unknown"
        got = files.crc_range(fd, off, length, path) if src is fd else _native.crc32c(pread(src, length, off))
        print(f"  bit {bit} ({name})  length {length}  crc {'ok' if got == crc else 'BAD (dropped on load)'}")


def copy_text(fd, e, out, d, sealer=None, chunk=TEXT_CHUNK):
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
                copy_segment(src, plain, out, chunk)
            else:
                copy_segment(pfd, p, out, chunk)
        finally:
            os.close(pfd)
    copy_segment(fd, e, out, chunk)


def copy_segment(fd, e, out, chunk):
    for off in range(0, e.segment_bytes, chunk):
        data = pread(fd, min(chunk, e.segment_bytes - off), e.text_offset + off)
        if not data:
            break
        out.write(data)


def inspect_open(args, path, fd, st, now):
    """Prints everything inspect shows of the open file; returns the exit status."""
    try:
        e = entry_from_fd(fd, st, path)
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {os.path.basename(path)}: corrupt envelope: {describe_error(err)}",
              file=sys.stderr)
        return 1
    rows = header_rows(e, path, now)
    if e.is_block:
        rows += block_rows(e, os.path.dirname(path))
    sealer = keys.sealer(args)
    src, plain, why, status = fd, e, None, 0
    if e.sealed:
        src, plain, why, status, row = unseal(sealer, fd, st, e)
        rows.append(row)
    print(text.pairs(rows))
    if why is not None:
        if args.text:
            raise UsageError(f"{e.name[:12]} is sealed: give its key (--key FILE or ${keys.KEY_ENV})")
        return status
    if plain.loadable:
        status = print_manifest(src, plain, e.sealed)
    print_trailers(fd, src, plain, path)
    title = sessions.read_title(e, sealer)
    if title is not None:
        print(f"title: {text.printable(title)}")
    if args.text:
        print("text:")
        sys.stdout.flush()
        copy_text(src, plain, sys.stdout.buffer, os.path.dirname(path), sealer)
        sys.stdout.buffer.write(b"\n")
        sys.stdout.buffer.flush()
    return status


def cmd_inspect(args):
    path = inspect_target(args)
    now = int(time.time())
    try:
        fd, st = open_checkpoint(path)
    except CheckpointMissing:
        raise UsageError(f"{path}: no such file") from None
    except UnsafePath:
        raise UsageError(f"{path}: not a regular file (kvstore never follows symlinks)") from None
    try:
        return inspect_open(args, path, fd, st, now)
    finally:
        os.close(fd)


def add_parsers(sub):
    """`kvstore inspect`."""
    s = sub.add_parser("inspect", help="show one checkpoint's header, manifest and trailer")
    s.add_argument("target", metavar="FILE|SHA-PREFIX")
    s.add_argument("--dir", default=".", help="directory to search for a hash prefix (default: .)")
    s.add_argument("--text", action="store_true", help="also print the stored prompt text")
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_inspect)
