"""`kvstore ls`: one row per checkpoint, best kept first (a bucket's objects with --remote).

A chained checkpoint (docs/format.md §14) is many block files: `ls` folds
them into one row per stored sequence (a save's last block, or a leaf) and
`ls --blocks` shows every file with its parent and range.  The row order is
eviction's own (kvstore.policy.eviction_order), reversed; a sequence's
blocks are the ones kvstore.files.ancestors finds in the directory.
"""

import json
import os
import time

from kvstore import ds4, identity, policy, registry, remote, sessions
from kvstore.cli import keys, text
from kvstore.cli.local import directory
from kvstore.cli.remote import cmd_remote_ls
from kvstore.cli.text import UsageError
from kvstore.files import BrokenChain, ancestors, scan_directory
from kvstore.directory import budget_bytes_for
from kvstore.errors import KVStoreError
from kvstore.payload import read_manifest
from kvstore import settings
from kvstore.settings import DEFAULT_STALE_AFTER_S

# The columns of the sequence table that hold numbers (right-aligned).
NUMBER_COLUMNS = ("TOKENS", "BLOCKS", "HITS", "CTX", "QUANT", "SIZE")


def rank(entries, now):
    """(score, entry), the best kept first: eviction's own order, reversed (the next victim last)."""
    order = policy.eviction_order(entries, now, stale_after_s=DEFAULT_STALE_AFTER_S)
    return [(policy.eviction_score(e, now), e) for e in reversed(order)]


def stored_sequences(entries):
    """The rows `ls` folds blocks into: every whole file, every last block of
    a save, and every block no other block continues."""
    parents = {e.parent for e in entries if e.is_block and e.parent}
    return [e for e in entries if e.ends_save or (e.is_block and e.sha not in parents)]


def sequence_chains(seqs, d, limit):
    """name -> the blocks of each sequence in d, first block first, as far as
    its parents are there (kvstore.files.ancestors, which reads each one).

    Shorter sequences go first, and a walk that reaches a sequence already
    walked takes that one's chain: a save that continues the last reads only
    its own new blocks.
    """
    out = {}
    for e in sorted(seqs, key=lambda x: x.tokens):
        chain = [e]
        try:
            for parent in ancestors(e, d, limit=limit, linked=False):
                if parent.name in out:
                    chain += reversed(out[parent.name])
                    break
                chain.append(parent)
        except BrokenChain:
            pass
        out[e.name] = chain[::-1]
    return out


def block_range(e):
    return f"{e.token_start}..{e.tokens}" if e.is_block else f"0..{e.tokens}"


def model_name(e, models):
    """A file that names its model shows the model; one that names none, its header model id."""
    return registry.describe_tag(e.model_tag, models) if e.model_tag else e.model_id


def json_row(score, e, now, title, models, sealer, chain):
    """One object of `ls --json` (chain: the sequence's blocks, or None with --blocks)."""
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
        "title": title, "score": score,
    }
    if e.is_block:
        row.update(parent=e.parent or None, token_start=e.token_start, text_start=e.text_start,
                   restorable=e.restorable, ends_save=e.ends_save)
    if chain is not None:
        row.update(blocks=len(chain) if e.is_block else 0, chain_bytes=sum(b.file_size for b in chain))
    return row


def block_table(ranked, titles, now):
    """`ls --blocks`: one row per file, with its parent and token range."""
    rows = [(e.sha[:12], text.reason_name(e.reason), block_range(e), e.parent[:12] if e.parent else "-",
             "yes" if e.restorable else "link", e.hits, text.abi(e), text.size(e.file_size),
             text.age(e.created_at, now), text.used(e, now), text.printable(titles[e.name], text.TITLE_COLUMN))
            for _, e in ranked]
    return text.table(rows, ("SHA", "REASON", "TOKENS", "PARENT", "LOADS", "HITS", "ABI", "SIZE", "AGE",
                             "USED", "TITLE"), right={5, 7})


def sequence_table(ranked, chains, titles, models, now, has_blocks):
    """`ls`: one row per stored sequence; a BLOCKS column where chains are (a
    directory of whole files keeps the table it always had)."""
    rows = [(e.sha[:12], text.reason_name(e.reason), e.tokens)
            + ((len(chains[e.name]) if e.is_block else "whole",) if has_blocks else ())
            + (e.hits, e.ctx_size, e.quant_bits, model_name(e, models), text.abi(e),
               text.size(sum(b.file_size for b in chains[e.name])), text.age(e.created_at, now),
               text.used(e, now), text.printable(titles[e.name], text.TITLE_COLUMN))
            for _, e in ranked]
    head = ("SHA", "REASON", "TOKENS") + (("BLOCKS",) if has_blocks else ()) + (
        "HITS", "CTX", "QUANT", "MODEL", "ABI", "SIZE", "AGE", "USED", "TITLE")
    return text.table(rows, head, right={i for i, h in enumerate(head) if h in NUMBER_COLUMNS})


def codec_line(entries):
    """What the codecs stored (docs/format.md §20), or None when no block is
    packed: the packed blocks, their codecs and their tensors' stored bytes
    against their raw ones, from each block's manifest (a sealed block's
    needs its key and is left out)."""
    raw = stored = blocks = 0
    codecs = set()
    for e in entries:
        if not e.packed:
            continue
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            m = read_manifest(fd, e)
        except (KVStoreError, OSError):
            continue
        finally:
            os.close(fd)
        blocks += 1
        for name, _, _, _, nbytes, _ in m.tensors:
            raw += nbytes
            stored += m.packed[name][0] if name in m.packed else nbytes
        codecs |= {form.codec for _, form in m.packed.values()}
    if not blocks:
        return None
    return (f"{text.plural(blocks, 'packed block')} ({', '.join(sorted(codecs)) or 'none shrank'}): their tensors "
            f"take {stored / raw if raw else 1:.2f} of their raw bytes ({text.size(stored)} for {text.size(raw)})")


def print_totals(entries, seqs, bad, sealer, budget, budget_derived=False):
    """The lines under the table: files, bytes against the budget, sealed, foreign and bad ones."""
    blocks = sum(1 for e in entries if e.is_block)
    total = sum(e.file_size for e in entries)
    ours = sum(1 for e in entries if sealer is not None and sealer.owns(e))
    theirs = sum(1 for e in entries if ds4.is_ds4(e))
    foreign = sum(1 for e in entries if not e.loadable) - ours - theirs
    if blocks:
        print(f"{text.plural(len(seqs), 'stored sequence')} in {text.plural(len(entries), 'file')} "
              f"({text.plural(blocks, 'chain block')}), {text.budget_line(total, budget, budget_derived)}")
    else:
        print(f"{len(entries)} checkpoint{'s' if len(entries) != 1 else ''}, {text.budget_line(total, budget, budget_derived)}")
    line = codec_line(entries)
    if line is not None:
        print(line)
    if ours:
        print(f"{ours} sealed with this key")
    if theirs:
        print(f"{theirs} written by ds4 (payload ABI 0 or 2): listed and counted in the budget, not loadable")
    if foreign:
        print(f"{foreign} with a foreign payload ABI (or sealed with another key): listed and counted in the "
              "budget, not loadable")
    if bad:
        print(f"{len(bad)} file{'s' if len(bad) != 1 else ''} with a bad envelope "
              f"(not counted; see `kvstore verify`)")


def cmd_ls(args):
    if args.remote:
        if args.dir is not None:
            raise UsageError("ls takes DIR or --remote, not both")
        return cmd_remote_ls(args)
    if args.dir is None:
        raise UsageError("ls needs DIR (or --remote s3://BUCKET/PREFIX)")
    d = directory(args.dir)
    sealer = keys.sealer(args)
    entries, bad = scan_directory(d)
    now = int(time.time())
    ranked = rank(entries, now)
    seqs = stored_sequences(entries)
    # --blocks shows every file on its own: no sequence's chain is walked.
    chains = {} if args.blocks else sequence_chains(seqs, d, limit=len(entries))
    if not args.blocks:
        ranked = [(score, e) for score, e in ranked if e.name in chains]
    titles = {e.name: sessions.read_title(e, sealer) for _, e in ranked}
    models = registry.read_registry(d)
    if args.json:
        print(json.dumps([json_row(score, e, now, titles[e.name], models, sealer, chains.get(e.name))
                          for score, e in ranked], indent=2, ensure_ascii=False))
        return 0
    if ranked and args.blocks:
        print(block_table(ranked, titles, now))
    elif ranked:
        print(sequence_table(ranked, chains, titles, models, now, any(e.is_block for e in entries)))
    else:
        print(f"no checkpoints in {d}")
    print_totals(entries, seqs, bad, sealer, *budget_bytes_for(d, text.budget_mb(args)))
    return 0


def add_parsers(sub):
    """`kvstore ls`."""
    s = sub.add_parser("ls", help="list checkpoints, best kept first (or a bucket's, with --remote)")
    s.add_argument("dir", metavar="DIR", nargs="?")
    s.add_argument("--json", action="store_true", help="a JSON list of objects")
    settings.add_arguments(s, ["budget_mb"],
                           doc={"budget_mb": text.budget_help("budget shown against the total, in MiB")})
    s.add_argument("--blocks", action="store_true", help="one row per chain block (parent, range), not per sequence")
    remote.add_arguments(s)
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_ls)
