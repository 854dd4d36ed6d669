"""`kvstore export` and `kvstore import`: one stored sequence as one plain .kv file, and back.

The work is kvstore.exchange's (export_checkpoint, import_checkpoint); this
module finds the checkpoint, opens the store with the file's own model, and
words the outcome.
"""

import os
import sys

from kvstore import registry, settings
from kvstore.cli import keys, text
from kvstore.cli.local import directory, match, open_store
from kvstore.cli.text import PROG, UsageError
from kvstore.errors import CorruptCheckpoint, UnsafePath
from kvstore.exchange import export_checkpoint, file_model, import_checkpoint
from kvstore.files import checkpoint_names, describe_error
from kvstore.format import open_checkpoint, read_entry
from kvstore.payload import read_manifest
from kvstore.store import KVStore

# The store settings `kvstore import` takes as options (kvstore.settings makes them).
IMPORT_SETTINGS = ("layout", "block_tokens", "budget_mb")


def model_of_file(d, e, sealer):
    """The model identity of a file that names one (docs/semantics.md §17): the
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


def cmd_export(args):
    d = directory(args.dir)
    name = match(checkpoint_names(d), args.target, d)
    try:
        e = read_entry(os.path.join(d, name))
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {name}: corrupt envelope: {describe_error(err)}", file=sys.stderr)
        return 1
    if os.path.isdir(args.file):
        raise UsageError(f"{args.file}: is a directory (give the file to write)")
    # A model id of the file's own: export reads any model's checkpoint.
    key = keys.key_file(args)
    if key is not None:
        keys.sealer(args)               # a bad key file is a usage error
    if e.sealed and key is None:
        raise UsageError(f"{name[:12]} is sealed: give its key (--key FILE or ${keys.KEY_ENV})")
    if e.sealed and not args.plain:
        raise UsageError("an export is one plain .kv file: the prompt text and its KV state in the clear; "
                         "pass --plain to write it anyway")
    store = open_store(d, key=key, model_id=e.model_id, quant_bits=e.quant_bits,
                       model_identity=model_of_file(d, e, keys.sealer(args)))
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
    try:
        chosen = settings.from_arguments(args, IMPORT_SETTINGS)
    except settings.BadSetting as e:
        raise UsageError(str(e)) from None
    try:
        e = read_entry(args.file)
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {args.file}: corrupt envelope: {describe_error(err)}", file=sys.stderr)
        return 1
    try:
        key = keys.key_file(args)
        if key is not None:
            keys.sealer(args)
        store = KVStore(args.dir, chosen, model_id=e.model_id, quant_bits=e.quant_bits, key=key,
                        model_identity=file_model(args.file) if e.model_tag else None)
    except UnsafePath:
        raise UsageError(f"{args.dir}: not a directory (kvstore never follows symlinks)") from None
    budget = store.budget_bytes
    try:
        got = import_checkpoint(store, args.file)
    except CorruptCheckpoint as err:
        print(f"{PROG}: error: {args.file}: {describe_error(err)}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if got is None:
        print(f"{PROG}: error: {args.file}: not stored (over the {text.size(budget)} "
              "budget; see --budget-mb)", file=sys.stderr)
        return 1
    print(f"imported {e.tokens} tokens as {got.name[:12]} in {args.dir}")
    return 0


def add_parsers(sub):
    """`kvstore export` and `kvstore import`."""
    s = sub.add_parser("export", help="write one stored sequence (a chain, or a whole file) as one .kv file")
    s.add_argument("target", metavar="SHA-PREFIX")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--dir", default=".", help="the cache directory (default: .)")
    s.add_argument("--plain", action="store_true",
                   help="export a sealed checkpoint anyway: the file holds the prompt in the clear")
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("import", help="store a .kv file (from export) in a cache directory")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--dir", required=True, help="the cache directory (created if missing)")
    settings.add_arguments(s, IMPORT_SETTINGS)
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_import)
