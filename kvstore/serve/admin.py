"""The admin API and page of kvstore serve: what the cache holds, and deleting from it.

Off unless the server runs with ``--admin`` or ``--admin-token TOKEN``; off,
its paths answer 404 as stock mlx-lm does.

    GET    /v1/cache           the cache as JSON (below)
    DELETE /v1/cache/PREFIX    the one checkpoint whose name starts with PREFIX
                               (4 to 40 lowercase hex digits); a chain block
                               takes the blocks after it
    DELETE /v1/cache           with a JSON body {"cache_salt": "..."}: that
                               tenant's checkpoints only; without a body:
                               every checkpoint of the directory
    GET    /cache              the page (kvstore.serve.page): the same numbers
                               drawn for a person, refreshing itself

Access.  Without a token only loopback peers (127.0.0.0/8, ::1, ::ffff:127.x)
may use these paths, and only under a loopback Host name (a web page whose
name was rebound to 127.0.0.1 must not reach them): others get 403.  (A
reverse proxy on the same machine makes every client a loopback peer: use
a token behind one.)  With
``--admin-token`` every request must carry ``Authorization: Bearer TOKEN``
(missing: 401 with ``WWW-Authenticate: Bearer``; wrong: 403; compared in
constant time); the page also takes ``?token=TOKEN`` in its URL (a browser
cannot set a header on navigation) and its script sends the header.  A
request whose Origin is not the server's own is refused (403), so that no
other web site open in a browser can delete through it; answers carry no
CORS header.  The token is never logged: the request line of every admin
request is logged without its query.

Nothing here ever answers with prompt text: the JSON holds numbers, file
names (digests), reasons, model labels and tenant tags (their first
TAG_DIGITS hex digits, never a salt).  A tenant delete reads the first bytes
of each chain's first block and of each whole file inside the store
(KVStore.starts_with) and answers only how many files went.

GET /v1/cache (numbers are ints unless said; "sha" is a name's first 12 hex digits):

    entries, bytes            checkpoint files of the directory (every model) and their bytes
    budget_bytes              the directory's disk budget (0: none)
    budget_derived            true when the budget is the default derived from the filesystem's size
    budget_used               bytes / budget_bytes (a float, 0..1 or above), null without a budget
    pinned_bytes              bytes live pins keep (each file once)
    pins                      [{sha, tokens, bytes, until (unix s), ttl_left_s, tenant (8 hex or null)}]
    models                    kvstore.registry.summarize of the directory: [{tag, name, identity,
                              entries, bytes, last_seen}], the most bytes first
    model_tag                 this server's model tag (6 hex), as in models[].tag
    layout, block_tokens,     how this server's store writes (kv_codec: "raw", "lossless", "q8" or "q4",
      kv_codec                docs/format.md §20)
    kv_ratio                  the bytes this server's saves stored of their tensors' bytes
                              (1.0 raw; ~0.53 q8 on bfloat16), null before its first save
    by_reason                 {reason name (cold, continued, evict, ...): bytes}
    ram                       {entries, bytes} of mlx-lm's RAM cache, or null
    activity                  kvstore.serve.activity.Activity.snapshot(): since (unix s),
                              requests / hit_rate (float) / tokens_reused by source (ram, disk,
                              remote, none), tokens_prefilled, tenants {tag: requests},
                              recent: [request traces, newest first, each with at and tenant]
    top                       the TOP stored sequences worth most (chain leaves, blocks no other
                              block continues, and whole files): [{sha, tokens, blocks, bytes (the
                              sequence's files), hits (as the header holds them now), reason, score}], score =
                              kvstore.policy.eviction_score of the leaf, highest first
    chains                    the TOP longest stored sequences: [{sha, tokens, bytes, whole (an
                              ABI 16 file), blocks: [{tokens (its own), bytes, hits}], first block first}]
    generated_at              unix seconds (float)
"""

import argparse
import hmac
import ipaddress
import json
import logging
import re
import time
import urllib.parse

from kvstore import pins as pins_mod
from kvstore import registry
from kvstore.format import envelope_now
from kvstore.identity import tag_hex
from kvstore.policy import eviction_score
from kvstore import tenants
from kvstore.serve import page
from kvstore.serve.activity import TAG_DIGITS

log = logging.getLogger("kvstore")

API = "/v1/cache"
PAGE = "/cache"
# Sequences listed under "top" and "chains": what a page shows at a glance.
TOP = 10
# A checkpoint's name in answers: 12 hex digits, as kvstore ls prints it.
SHA_DIGITS = 12
# A DELETE names a checkpoint by the first 4 to 40 hex digits of its name
# (kvstore export takes the same prefixes).
PREFIX = re.compile(r"[0-9a-f]{4,40}")
# A DELETE body holds one salt (tenants.MAX_SALT_CHARS): more is not a request of ours.
MAX_BODY_BYTES = 64 << 10
# A shorter bearer token could be guessed over the network.
MIN_TOKEN_CHARS = 16
# Visible ASCII only: a token travels in an HTTP header and a URL.
_TOKEN = re.compile(r"[\x21-\x7e]+")
RETRY_AFTER_S = 2


def token_arg(text):
    """argparse type of --admin-token: a token of at least MIN_TOKEN_CHARS visible ASCII
    characters (the message never repeats it)."""
    if not _TOKEN.fullmatch(text or ""):
        raise argparse.ArgumentTypeError("the token must be visible ASCII characters, no spaces")
    if len(text) < MIN_TOKEN_CHARS:
        raise argparse.ArgumentTypeError(f"the token is {len(text)} characters long; at least "
                                         f"{MIN_TOKEN_CHARS} are needed (python -c 'import secrets; "
                                         "print(secrets.token_urlsafe(32))')")
    return text


def add_arguments(p):
    """`kvstore serve`'s admin options: --admin and --admin-token."""
    p.add_argument("--admin", action="store_true",
                   help="serve the admin API (GET /v1/cache: what the cache holds, as JSON; DELETE "
                        "/v1/cache/SHA-PREFIX, and DELETE /v1/cache with or without {\"cache_salt\": ...}) and "
                        "the page GET /cache, to loopback clients only (a proxy on this machine makes every "
                        "client one: use --admin-token behind it); default: off, those paths answer 404")
    p.add_argument("--admin-token", metavar="TOKEN", type=token_arg, default=None,
                   help="require this bearer token on the admin API and page, from any client (implies "
                        "--admin): requests send `Authorization: Bearer TOKEN`, a browser opens "
                        f"/cache?token=TOKEN; at least {MIN_TOKEN_CHARS} visible ASCII characters. "
                        "Other users of this machine can read a command line")


def from_options(opts, store, activity, tier=None):
    """The server's Admin, or None when the options leave it off.

    Args:
        opts: `kvstore serve`'s options (admin, admin_token).
        store: a callable giving the server's KVStore, or None before it opens.
        activity: the server's kvstore.serve.activity.Activity.
        tier: the server's TieredPromptCache (its RAM), or None.
    """
    token = getattr(opts, "admin_token", None)
    if not (getattr(opts, "admin", False) or token):
        return None
    log.info("kvstore: admin enabled=1 access=%s", "token" if token else "loopback")
    return Admin(store, activity, tier, token)


def is_loopback(host):
    """True for a loopback address: 127.0.0.0/8, ::1, or an IPv4-mapped 127.x."""
    try:
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _netloc(url):
    """The host:port of a URL, lowercased ("" when it has none or is not a URL)."""
    try:
        return urllib.parse.urlsplit(url).netloc.lower()
    except ValueError:
        return ""


def _host_name(value):
    """The host name of a Host header value (no port), lowercased; "" for none, None for one that is not a name."""
    try:
        return (urllib.parse.urlsplit("//" + value).hostname or "") if value else ""
    except ValueError:
        return None


def route(method, path):
    """What an admin request asks for: "page", "get", "delete_all", ("delete", prefix), or None."""
    parts = urllib.parse.urlsplit(path)
    if method == "GET":
        return {API: "get", PAGE: "page"}.get(parts.path)
    if method == "DELETE":
        if parts.path == API:
            return "delete_all"
        if parts.path.startswith(API + "/"):
            return ("delete", urllib.parse.unquote(parts.path[len(API) + 1:]))
    return None


class Admin:
    """The admin API of one server.

    Args:
        store: a callable giving the server's KVStore, or None before it opens.
        activity: the server's Activity, or None.
        tier: the server's TieredPromptCache, or None.
        token: the bearer token every request must carry, or None (loopback only).
    """

    def __init__(self, store, activity=None, tier=None, token=None, clock=time.time):
        self._store = store
        self.activity = activity
        self.tier = tier
        self._token = token.encode() if token else None
        self._clock = clock

    def handles(self, method, path):
        """True when method and path are the admin API's (the handler then calls serve)."""
        return route(method, path) is not None

    def refusal(self, peer, headers, query=None):
        """None when a request may use the admin API, else (status, message, extra headers).

        Args:
            peer: the client's address.
            headers: the request's headers (a mapping with .get).
            query: the page's ?token= value, or None.
        """
        origin = headers.get("Origin")
        host = headers.get("Host") or ""
        if origin is not None and _netloc(origin) != host.lower():
            return 403, "cross-origin requests are refused", ()
        if self._token is None:
            name = _host_name(host)
            if not is_loopback(peer):
                return 403, "the admin API answers loopback clients only (start the server with --admin-token " \
                            "to reach it from elsewhere)", ()
            if name is None or not (name in ("", "localhost") or is_loopback(name)):
                return 403, "the admin API answers requests to a loopback host name only", ()
            return None
        given = _bearer(headers.get("Authorization"))
        if given is None:
            given = query
        if given is None:
            return 401, "this server needs Authorization: Bearer TOKEN (--admin-token)", \
                (("WWW-Authenticate", 'Bearer realm="kvstore"'),)
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self._token):
            return 403, "wrong admin token", ()
        return None

    def serve(self, handler):
        """Answers one admin request on an mlx-lm APIHandler (kvstore.serve.http)."""
        parts = urllib.parse.urlsplit(handler.path)
        # mlx-lm logs every request line: this one without its query, where a page's token may be.
        handler.requestline = f"{handler.command} {parts.path} {handler.request_version}"
        what = route(handler.command, handler.path)
        query = None
        if what == "page":
            query = urllib.parse.parse_qs(parts.query).get("token", [None])[-1]
        refused = self.refusal(handler.client_address[0], handler.headers, query)
        if refused is not None:
            status, message, extra = refused
            return send_json(handler, status, {"error": message}, extra)
        try:
            if what == "page":
                return send(handler, 200, page.HTML.encode(), "text/html; charset=utf-8", page.HEADERS)
            store = self._store()
            if store is None:
                return send_json(handler, 503, {"error": "the cache opens once the model has loaded; retry shortly"},
                                 (("Retry-After", str(RETRY_AFTER_S)),))
            if what == "get":
                return send_json(handler, 200, self.view(store))
            if what == "delete_all":
                return self._delete_all(handler, store)
            return self._delete_prefix(handler, store, what[1])
        except (BrokenPipeError, ConnectionResetError):
            return None                 # the client left
        except Exception as e:          # noqa: BLE001 - an admin request never takes the server down
            log.warning("kvstore: admin_failed method=%s error=%s", handler.command, type(e).__name__)
            return send_json(handler, 500, {"error": f"the cache could not be read or changed ({type(e).__name__})"})

    # -- GET ------------------------------------------------------------------

    def view(self, store):
        """The GET /v1/cache object (the module's docstring lists it)."""
        now = self._clock()
        entries = store.entries()
        by_sha = {e.sha: e for e in entries}
        size = sum(e.file_size for e in entries)
        budget = store.budget_bytes
        live = store.pins()
        seqs = sequences(entries)
        # The leaves' hits as their headers say now: they rank the sequences.
        leaves = hits_now([leaf for leaf, _ in seqs])
        seqs = [(leaf, files[:-1] + [leaf]) for leaf, (_, files) in zip(leaves, seqs)]
        half_life = store.settings.hit_half_life_s
        ram = None
        if self.tier is not None:
            ram = {"entries": len(self.tier), "bytes": int(self.tier.nbytes)}
        return {
            "entries": len(entries), "bytes": size, "budget_bytes": budget,
            "budget_derived": store.budget_derived,
            "budget_used": size / budget if budget else None,
            "pinned_bytes": pins_mod.kept(live, by_sha)[1],
            "pins": [pin_view(p, now) for p in live],
            "models": registry.summarize(entries, registry.read_registry(store.path)),
            "model_tag": tag_hex(store.model_tag), "layout": store.settings.layout,
            "block_tokens": store.settings.block_tokens,
            "kv_codec": store.settings.kv_codec, "kv_ratio": store.stats()["kv_ratio"],
            "by_reason": by_reason(entries),
            "ram": ram,
            "activity": self.activity.snapshot() if self.activity is not None else None,
            "top": top(seqs, now, half_life),
            "chains": chains(seqs),
            "generated_at": round(now, 3),
        }

    # -- DELETE ---------------------------------------------------------------

    def _delete_prefix(self, handler, store, prefix):
        if not PREFIX.fullmatch(prefix):
            return send_json(handler, 400, {"error": f"{prefix[:64]!r} is not a checkpoint name prefix: 4 to 40 "
                                                     "lowercase hex digits"})
        matched = [e for e in store.entries() if e.sha.startswith(prefix)]
        if not matched:
            return send_json(handler, 404, {"error": f"no checkpoint name starts with {prefix}"})
        if len(matched) > 1:
            return send_json(handler, 409, {"error": f"{len(matched)} checkpoints' names start with {prefix}: "
                                                     "give more digits (nothing was deleted)",
                                            "matched": len(matched)})
        e = matched[0]
        # The RAM entries that hold its text, so that none is stored again.
        self._forget(store, lambda tenant, tokens: self._holds(store, e, tenant, tokens))
        n = store.wipe(e)
        log.info("kvstore: admin_delete scope=one files=%d file=%s", n, matched[0].sha[:SHA_DIGITS])
        return send_json(handler, 200, {"deleted": n})

    def _delete_all(self, handler, store):
        body, error = read_body(handler)
        if error is not None:
            return send_json(handler, error[0], {"error": error[1]})
        if body is None:
            ram = self._forget(store, None)
            n = store.wipe()
            log.info("kvstore: admin_delete scope=all files=%d ram=%d", n, ram)
            return send_json(handler, 200, {"deleted": n, "ram_dropped": ram})
        try:
            salt = tenants.check_salt(body["cache_salt"])
        except ValueError as e:
            return send_json(handler, 400, {"error": str(e)})
        if salt is None:
            return send_json(handler, 400, {"error": "cache_salt must be a string, not null (send no body to "
                                                     "delete every checkpoint)"})
        tag = tenants.tag(salt)
        ram = self._forget(store, lambda tenant, tokens: tenant == tag)
        n = sum(store.wipe(e) for e in tenant_heads(store, store.entries(), tenants.key_prefix(tag)))
        log.info("kvstore: admin_delete scope=tenant tenant=%s files=%d ram=%d", tag[:TAG_DIGITS], n, ram)
        return send_json(handler, 200, {"deleted": n, "ram_dropped": ram})

    def _forget(self, store, select):
        """Drops the RAM entries select(tenant, tokens) accepts (None: all) so that
        nothing stores them again, then waits for the saves queued before; the
        RAM entries dropped."""
        ram = self.tier.forget(select) if self.tier is not None else 0
        store.flush()
        return ram

    def _holds(self, store, entry, tenant, tokens):
        """True when the RAM entry of tokens (a tenant's) holds entry's whole stored text."""
        key = self.tier.key_bytes(tokens, tenant)
        return len(key) >= entry.text_bytes and store.starts_with(entry, key[:entry.text_bytes])


# ---- the JSON's parts --------------------------------------------------------------

def pin_view(p, now):
    """One pin as GET /v1/cache shows it."""
    return {"sha": p.sha[:SHA_DIGITS], "tokens": p.tokens, "bytes": p.bytes, "until": p.until,
            "ttl_left_s": max(0, int(p.until - now)), "tenant": p.tenant[:TAG_DIGITS] or None}


def by_reason(entries):
    """{reason name: bytes} of entries, the most bytes first."""
    out = {}
    for e in entries:
        name = e.reason.name.lower()
        out[name] = out.get(name, 0) + e.file_size
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def hits_now(entries):
    """entries with the hits and last use their headers hold now: a load writes them in place,
    and the directory's index reads a header again only once the directory changes."""
    out = []
    for e in entries:
        cur = envelope_now(e.path)
        out.append(e if cur is None or cur.sha != e.sha else e.but(hits=cur.hits, last_used=cur.last_used))
    return out


def sequences(entries):
    """Every stored sequence: (its last entry, [its files, the first block first]).

    A sequence ends at a chain leaf (a block no other block continues) or is
    a whole file; a chain whose first blocks are missing starts at its first
    block present.
    """
    by_sha = {e.sha: e for e in entries}
    continued = {e.parent for e in entries if e.is_block and e.parent}
    out = []
    for e in entries:
        if e.sha in continued:
            continue
        files = [e]
        while files[-1].is_block and files[-1].parent in by_sha and len(files) <= len(by_sha):
            files.append(by_sha[files[-1].parent])
        out.append((e, files[::-1]))
    return out


def top(seqs, now, half_life_s):
    """The TOP sequences of most value (their leaf's eviction score), highest first."""
    scored = sorted(((eviction_score(leaf, now, half_life_s=half_life_s), leaf.tokens, leaf.sha, leaf, files)
                     for leaf, files in seqs), key=lambda t: (-t[0], -t[1], t[2]))
    return [{"sha": leaf.sha[:SHA_DIGITS], "tokens": leaf.tokens, "blocks": len(files),
             "bytes": sum(f.file_size for f in files), "hits": leaf.hits, "reason": leaf.reason.name.lower(),
             "score": score}
            for score, _, _, leaf, files in scored[:TOP]]


def chains(seqs):
    """The TOP longest sequences with their blocks (the page's picture), longest first."""
    longest = sorted(seqs, key=lambda s: (-s[0].tokens, s[0].sha))[:TOP]
    return [{"sha": leaf.sha[:SHA_DIGITS], "tokens": leaf.tokens, "bytes": sum(f.file_size for f in files),
             "whole": not leaf.is_block,
             "blocks": [{"tokens": f.tokens - f.token_start, "bytes": f.file_size, "hits": f.hits}
                        for f in hits_now(files)]}
            for leaf, files in longest]


def tenant_heads(store, entries, prefix):
    """The whole files and chains' first blocks whose stored text starts with
    prefix (a tenant's key prefix): what a tenant delete wipes (a first block
    takes its chain).  The text is compared inside the store, never returned."""
    return [e for e in entries if not (e.is_block and e.parent) and store.starts_with(e, prefix)]


# ---- the HTTP side -----------------------------------------------------------------

def _bearer(value):
    """The credentials of an `Authorization: Bearer X` header; "" for another scheme; None when absent."""
    if value is None:
        return None
    scheme, _, cred = value.strip().partition(" ")
    return cred.strip() if scheme.lower() == "bearer" else ""


def read_body(handler):
    """(the DELETE body's JSON object or None when there is none, None) or (None, (status, message))."""
    if handler.headers.get("Transfer-Encoding"):
        return None, (411, "send the body with a Content-Length")
    length = handler.headers.get("Content-Length")
    try:
        n = int(length) if length is not None else 0
    except ValueError:
        return None, (400, f"Content-Length {length!r} is not a number")
    if n < 0 or n > MAX_BODY_BYTES:
        return None, (413, f"the body is {n} bytes; at most {MAX_BODY_BYTES} are accepted")
    raw = handler.rfile.read(n) if n else b""
    if not raw.strip():
        return None, None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, (400, "the body is not JSON")
    if not isinstance(body, dict) or set(body) != {"cache_salt"}:
        got = ", ".join(repr(k[:40]) for k in sorted(body)[:5]) if isinstance(body, dict) else type(body).__name__
        return None, (400, f'the body must be {{"cache_salt": "..."}} alone, not {got or "{}"} (send no body to '
                           "delete every checkpoint)")
    return body, None


def send(handler, status, body, content_type, headers=()):
    """Sends one whole answer: no CORS header, never cached."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Cache-Control", "no-store")
    handler.send_header("X-Content-Type-Options", "nosniff")
    for k, v in headers:
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(body)


def send_json(handler, status, obj, headers=()):
    send(handler, status, json.dumps(obj).encode(), "application/json", headers)


__all__ = ["Admin", "from_options", "token_arg", "route", "is_loopback", "sequences", "top", "chains",
           "API", "PAGE", "TOP", "MIN_TOKEN_CHARS"]
