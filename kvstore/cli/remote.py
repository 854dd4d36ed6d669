"""The remote commands: `kvstore ls --remote` and `kvstore remote gc` (the bucket's janitor).

Errors are one line: a failed call is classified (kvstore.remote.classify)
and worded with a hint at what to check.
"""

import json
import time

from kvstore import remote
from kvstore.cli import text
from kvstore.cli.text import UsageError


def _bucket(args):
    """The bucket named by --remote; UsageError for a bad URL or a missing boto3."""
    if not args.remote:
        raise UsageError("--remote s3://BUCKET/PREFIX is required")
    try:
        return remote.Bucket(args.remote, remote.options_from_args(args))
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None
    except Exception as e:                 # noqa: BLE001 - a profile or region that does not resolve
        raise UsageError(f"{args.remote}: {_remote_failure(e)}") from None


def _remote_failure(exc):
    f = remote.classify(exc)
    status = f" (HTTP {f.status})" if f.status else ""
    hint = {remote.DENIED: "; check the credentials (AWS_PROFILE, --profile, AWS_ACCESS_KEY_ID, "
                               "~/.aws/credentials) and the identity's permissions",
            remote.UNAVAILABLE: "; check --endpoint-url and that the store is reachable"}.get(f.kind, "")
    return f"{f.kind}: {f.code}{status}{hint}"


def _remote_call(args, fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except remote.RemoteError:
        raise
    except Exception as e:                 # noqa: BLE001 - one line, classified
        raise remote.RemoteError(f"{args.remote}: {_remote_failure(e)}") from None


def cmd_remote_ls(args):
    bucket = _bucket(args)
    objects = _remote_call(args, remote.list_objects, bucket)
    now = time.time()
    objects.sort(key=lambda o: (-o.modified, o.key))
    if args.json:
        print(json.dumps([{"key": o.key, "sha": o.sha, "fingerprint": o.fingerprint, "text_bytes": o.text_bytes,
                           "size": o.size, "modified": o.modified} for o in objects], indent=2))
        return 0
    if objects:
        rows = [(o.sha[:12], o.fingerprint[:12], o.text_bytes, text.size(o.size), text.span(now - o.modified) + " ago")
                for o in objects]
        print(text.table(rows, ("SHA", "MODEL", "TEXT", "SIZE", "UPLOADED"), right={2, 3}))
    total = sum(o.size for o in objects)
    models = len({o.fingerprint for o in objects})
    print(f"{len(objects)} object{'s' if len(objects) != 1 else ''}, {text.size(total)} in {args.remote}"
          + (f" ({models} model{'s' if models != 1 else ''})" if objects else ""))
    return 0


def cmd_remote_gc(args):
    bucket = _bucket(args)
    budget = int(args.budget_gb * 2**30)
    max_age = None if args.max_age_days is None else args.max_age_days * 86400
    victims, before, after = _remote_call(args, remote.gc, bucket, budget, dry_run=args.dry_run,
                                          max_age_s=max_age, min_age_s=args.min_age_s)
    verb = "would delete" if args.dry_run else "deleted"
    for o, e in victims:
        what = (f"{text.reason_name(e.reason)}  tokens {e.tokens}  hits {e.hits}" if e is not None
                else "expired" if max_age is not None and time.time() - o.modified > max_age else "unreadable header")
        print(f"{verb} {o.sha[:12]}  {what}  {text.size(o.size)}")
    print(f"{verb} {len(victims)} object{'s' if len(victims) != 1 else ''} ({text.size(before - after)}); "
          f"{'would leave' if args.dry_run else 'now'} {text.budget_line(after, budget)} (was {text.size(before)})")
    if not args.dry_run:
        n = _remote_call(args, remote.abort_stale_uploads, bucket)
        if n:
            print(f"aborted {n} stale multipart upload{'s' if n != 1 else ''}")
    return 0


def add_parsers(sub):
    """`kvstore remote ls` and `kvstore remote gc` (`ls --remote` is wired in listing.py)."""
    s = sub.add_parser("remote", help="the shared bucket of the remote tier: ls, gc")
    rs = s.add_subparsers(dest="remote_command", metavar="SUBCOMMAND", required=True)
    s = rs.add_parser("ls", help="list the bucket's checkpoints, newest first")
    remote.add_arguments(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_remote_ls)
    s = rs.add_parser("gc", help="delete lowest-score objects until the bucket fits a budget "
                                 "(the one janitor: clients never delete)")
    remote.add_arguments(s)
    s.add_argument("--budget-gb", type=text.gigabytes, required=True, help="GiB for every object under the prefix")
    s.add_argument("--max-age-days", type=float, default=None,
                   help="also delete objects uploaded longer ago than this")
    s.add_argument("--min-age-s", type=float, default=remote.GC_MIN_AGE_S,
                   help=f"keep objects younger than this (default {remote.GC_MIN_AGE_S:g}): "
                        "another host may be about to find them")
    s.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    s.set_defaults(func=cmd_remote_gc)
