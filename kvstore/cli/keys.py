"""Store keys of sealed checkpoints (docs/format.md §16): --key, $KVSTORE_KEY_FILE and `kvstore key new`.

The commands that open a store or authenticate files take the key from
--key FILE or the KVSTORE_KEY_FILE environment variable; without it, sealed
files are listed as foreign.
"""

import os

from kvstore import seal
from kvstore.cli.text import UsageError

KEY_ENV = "KVSTORE_KEY_FILE"


def key_file(args):
    """The key file of a command: --key FILE, else $KVSTORE_KEY_FILE, else None."""
    return getattr(args, "key", None) or os.environ.get(KEY_ENV) or None


def sealer(args):
    """A kvstore.seal.Sealer for the command's key file, or None; a bad key file is a usage error."""
    path = key_file(args)
    if path is None:
        return None
    try:
        return seal.Sealer(path)
    except (ValueError, OSError, ImportError) as e:
        raise UsageError(f"key: {e}") from None


def add_key_argument(s):
    """The --key FILE option of a command that reads sealed checkpoints."""
    s.add_argument("--key", metavar="FILE", help=f"the store key of sealed checkpoints (default: ${KEY_ENV})")


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


def add_parsers(sub):
    """`kvstore key new`."""
    s = sub.add_parser("key", help="store keys of sealed checkpoints")
    ks = s.add_subparsers(dest="key_command", metavar="SUBCOMMAND", required=True)
    s = ks.add_parser("new", help="write a fresh random 32-byte key to FILE (0600); never overwrites")
    s.add_argument("file", metavar="FILE")
    s.set_defaults(func=cmd_key_new)
