"""The admin API and page of kvstore serve (kvstore.serve.admin, kvstore.serve.page):
who may use them, GET /v1/cache against the directory, deletes, and the
page in a real headless browser, against real server processes."""

import html.parser
import http.client
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvstore import KVStore, registry
from kvstore.demo.model import prose
from kvstore.format import PREFIX_SIZE
from kvstore import tenants
from kvstore.serve import admin, page
from kvhelpers import checkpoint_files, colliding_texts, kvstore_server, make_store, make_tensors

TOKEN = "kv-admin-test-token-7f3a9c1e5b2d"
SALT_A, SALT_B = "tenant-alpha-salt-4411", "tenant-beta-salt-9922"
# Words no answer may hold: the user turns' own, and the salts.
MARKERS = ("Quokkablanket", "zephyrmint", SALT_A, SALT_B)
PIN_1H = {"type": "ephemeral", "ttl": "1h"}
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def system(topic):
    return prose([topic])[:2500]


def messages(topic, question="Quokkablanket: what is this about?"):
    return [{"role": "system", "content": system(topic)}, {"role": "user", "content": question}]


def chat(server, msgs, salt=None):
    body = {"messages": msgs, "max_tokens": 2, "temperature": 0.0}
    if salt is not None:
        body["cache_salt"] = salt
    status, r = server.post(body)
    assert status == 200, r
    return r["usage"]["kvstore"]


def call(server, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request; headers may set Host and Origin."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=dict(headers or {}))
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def get_json(server, path="/v1/cache", headers=None):
    status, _, body = call(server, "GET", path, headers=headers)
    assert status == 200, body
    return json.loads(body)


def settled(server, headers=None):
    """GET /v1/cache once the directory has stopped changing (background writes done)."""
    last = None
    for _ in range(100):
        view = get_json(server, headers=headers)
        key = (view["entries"], view["bytes"], sorted(c["sha"] for c in view["chains"]))
        if key == last:
            return view
        last = key
        time.sleep(0.5)
    raise AssertionError("the directory kept changing")


def quiet(cache):
    """The directory's listing once it has stopped changing (the server's background writes done)."""
    last = None
    for _ in range(100):
        names = sorted(os.listdir(cache))
        if names == last and not any(".tmp." in n for n in names):
            return names
        last = names
        time.sleep(0.5)
    raise AssertionError("the directory kept changing")


def assert_no_text(*bodies):
    """No prompt word, marker, salt or long piece of a system prompt in what the server answered."""
    pieces = list(MARKERS) + [system(t)[i:i + 32] for t in ("json", "csv", "logging", "argparse") for i in (0, 700)]
    for body in bodies:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else json.dumps(body)
        for piece in pieces:
            assert piece not in text, piece


def chains_of(cache):
    """{root sha: set of the file names (sha) of its chain} for every chain's first block and whole file."""
    with KVStore(cache) as store:
        entries = store.entries()
    kids = {}
    for e in entries:
        kids.setdefault(e.parent, []).append(e)
    out = {}
    for e in entries:
        if e.is_block and e.parent:
            continue
        todo, names = [e], set()
        while todo:
            cur = todo.pop()
            names.add(cur.sha)
            todo += kids.get(cur.sha, []) if cur.is_block else []
        out[e.sha] = names
    return out


def tenant_files(cache, salt):
    """The names of the files of every chain whose first block's text opens with the salt's key prefix,
    read from the files' bytes (the envelope's text starts at PREFIX_SIZE)."""
    prefix = tenants.key_prefix(tenants.tag(salt))
    out = set()
    for root, names in chains_of(cache).items():
        with open(os.path.join(cache, root + ".kv"), "rb") as f:
            f.seek(PREFIX_SIZE)
            if f.read(len(prefix)) == prefix:
                out |= names
    return out


@pytest.fixture(scope="module")
def served(model_dir, workdir):
    """An --admin server (RAM for one prompt) that has served a few requests: two tenants,
    a pin, RAM and disk hits."""
    cache = os.path.join(workdir, "cache-admin")
    server = kvstore_server(model_dir, cache, workdir, "admin", "--admin", "--prompt-cache-size", "1")
    try:
        traces = [chat(server, messages("json")), chat(server, messages("json")),
                  chat(server, messages("csv")), chat(server, messages("logging"), SALT_A),
                  chat(server, [{"role": "system", "content": system("argparse"), "cache_control": PIN_1H},
                                {"role": "user", "content": "zephyrmint?"}], SALT_B)]
        time.sleep(1.0)              # the stores of the first request are written
        traces.append(chat(server, messages("json")))
        sources = {t["source"] for t in traces}
        assert {"none", "ram", "disk"} <= sources, traces
        deadline = time.monotonic() + 60
        while not get_json(server)["pins"]:
            assert time.monotonic() < deadline, "tenant B's pin was not granted"
            time.sleep(0.3)
        yield server, cache, len(traces)
    finally:
        server.kill()


@pytest.fixture(scope="module")
def token_server(model_dir, workdir):
    cache = os.path.join(workdir, "cache-token")
    server = kvstore_server(model_dir, cache, workdir, "admin-token", "--admin-token", TOKEN)
    try:
        chat(server, messages("email.message"))
        yield server, cache
    finally:
        server.kill()


BEARER = {"Authorization": f"Bearer {TOKEN}"}


# ---- who may use it ----------------------------------------------------------------------

def test_without_admin_the_paths_answer_404_as_stock_mlx_lm(model_dir, workdir):
    cache = os.path.join(workdir, "cache-off")
    server = kvstore_server(model_dir, cache, workdir, "admin-off")
    try:
        chat(server, messages("json"))
        before = quiet(cache)
        name = checkpoint_files(cache)[0]
        for method, path in (("GET", "/v1/cache"), ("GET", "/cache"), ("GET", "/cache?token=x"),
                             ("DELETE", "/v1/cache"), ("DELETE", "/v1/cache/" + name[:8])):
            status, _, body = call(server, method, path)
            assert status == 404 and body == b"Not Found", (method, path, status)
        assert sorted(os.listdir(cache)) == before
    finally:
        server.kill()


def test_loopback_clients_may_use_it_without_a_token(served):
    server, _, _ = served
    status, headers, body = call(server, "GET", "/v1/cache")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert "Access-Control-Allow-Origin" not in headers          # no other site's script may read it
    status, headers, body = call(server, "GET", "/cache")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and body == page.HTML.encode()
    assert "connect-src 'self'" in headers["Content-Security-Policy"]


def test_another_host_name_or_origin_is_refused_and_deletes_nothing(served):
    server, cache, _ = served
    before = quiet(cache)
    # A page whose name was rebound to 127.0.0.1, and a script of another site.
    for headers in ({"Host": f"attacker.example:{server.port}"}, {"Origin": "http://attacker.example"},
                    {"Origin": "null"}):
        for method, path in (("GET", "/v1/cache"), ("GET", "/cache"), ("DELETE", "/v1/cache")):
            status, _, body = call(server, method, path, headers=headers)
            assert status == 403, (headers, method, status, body)
    assert sorted(os.listdir(cache)) == before
    # The server's own origin is fine.
    status, _, _ = call(server, "GET", "/v1/cache", headers={"Origin": f"http://127.0.0.1:{server.port}"})
    assert status == 200


@pytest.mark.parametrize("peer, ok", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                      ("::ffff:127.0.0.1", True), ("10.0.0.5", False), ("192.168.1.2", False),
                                      ("::ffff:10.0.0.5", False), ("2001:db8::1", False), ("localhost", False)])
def test_without_a_token_only_loopback_peers_pass(peer, ok):
    refused = admin.Admin(lambda: None).refusal(peer, {"Host": "127.0.0.1:8080"})
    assert (refused is None) == ok, refused
    if not ok:
        assert refused[0] == 403 and "loopback" in refused[1]


def test_with_a_token_missing_is_401_wrong_is_403_right_is_200(token_server):
    server, cache = token_server
    view = settled(server, headers=BEARER)
    before = quiet(cache)
    name = checkpoint_files(cache)[0]
    status, headers, body = call(server, "GET", "/v1/cache")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer") and b"Authorization" in body
    for wrong in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer ", f"Basic {TOKEN}"):
        status, _, _ = call(server, "GET", "/v1/cache", headers={"Authorization": wrong})
        assert status == 403, wrong
    for method in ("DELETE",):
        assert call(server, method, "/v1/cache")[0] == 401
        assert call(server, method, "/v1/cache", headers={"Authorization": "Bearer nope"})[0] == 403
        assert call(server, method, "/v1/cache/" + name[:8], headers={"Authorization": "Bearer nope"})[0] == 403
    assert sorted(os.listdir(cache)) == before
    assert view["entries"] == len(checkpoint_files(cache)) > 0
    # With the token, any host name (a client elsewhere reaches it by its name).
    assert call(server, "GET", "/v1/cache", headers={**BEARER, "Host": "kv.example"})[0] == 200
    # The page: the token in its URL, since a browser cannot set a header on navigation.
    assert call(server, "GET", "/cache")[0] == 401
    assert call(server, "GET", "/cache?token=wrong-token-wrong-token")[0] == 403
    status, _, body = call(server, "GET", f"/cache?token={TOKEN}")
    assert status == 200 and body == page.HTML.encode()
    # The token never reaches the log (mlx-lm logs every request line).
    assert TOKEN not in server.text() and "/cache" in server.text()


def test_a_bad_admin_token_option_exits_2_without_repeating_it(model_dir, workdir):
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--model", model_dir, "--admin-token", "short1"],
                       cwd=workdir, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "at least 16" in p.stderr and "short1" not in p.stderr, p.stderr


# ---- GET /v1/cache -------------------------------------------------------------------------

def test_get_cache_matches_the_directory(served):
    server, cache, n_requests = served
    view = settled(server)
    with KVStore(cache) as store:
        entries = store.entries()
        stats = store.stats()
        pins = store.pins()
    assert view["entries"] == stats["entries"] == len(entries) == len(checkpoint_files(cache))
    assert view["bytes"] == stats["bytes"] == sum(e.file_size for e in entries)
    assert view["budget_bytes"] == stats["budget_bytes"] and view["budget_used"] == view["bytes"] / view["budget_bytes"]
    assert view["budget_derived"] is stats["budget_derived"] is True     # no --budget-mb: derived, as here
    assert view["models"] == registry.summarize(entries, registry.read_registry(cache)) == stats["models"]
    assert view["pinned_bytes"] == stats["pinned_bytes"] > 0
    assert [(p["sha"], p["tokens"], p["until"]) for p in view["pins"]] == \
        [(p.sha[:12], p.tokens, p.until) for p in pins]
    assert view["pins"][0]["tenant"] == tenants.tag(SALT_B)[:8]
    by_reason = {}
    for e in entries:
        by_reason[e.reason.name.lower()] = by_reason.get(e.reason.name.lower(), 0) + e.file_size
    assert view["by_reason"] == by_reason
    # The sequences: chain leaves (blocks no block continues) and whole files.
    by_sha = {e.sha[:12]: e for e in entries}
    parents = {e.parent[:12] for e in entries if e.parent}
    assert view["chains"] and all(c["sha"] not in parents for c in view["chains"])
    assert [c["tokens"] for c in view["chains"]] == sorted((c["tokens"] for c in view["chains"]), reverse=True)
    full = {e.sha: e for e in entries}
    for c in view["chains"]:
        assert c["tokens"] == by_sha[c["sha"]].tokens == sum(b["tokens"] for b in c["blocks"])
        assert c["bytes"] == sum(b["bytes"] for b in c["blocks"])
        files = [by_sha[c["sha"]]]
        while files[-1].parent:
            files.append(full[files[-1].parent])
        # Hits as the headers hold them now (a load writes them in place).
        assert [b["hits"] for b in c["blocks"]] == [e.hits for e in reversed(files)]
    assert any(b["hits"] for c in view["chains"] for b in c["blocks"])       # the disk hit
    assert all(t["hits"] == by_sha[t["sha"]].hits for t in view["top"])
    assert view["top"] and all(t["sha"] not in parents for t in view["top"])
    assert [t["score"] for t in view["top"]] == sorted((t["score"] for t in view["top"]), reverse=True)
    # What this server served, by source, and its tenants as tags.
    a = view["activity"]
    assert sum(a["requests"].values()) == len(a["recent"]) == n_requests
    assert a["requests"]["ram"] >= 1 and a["requests"]["disk"] >= 1 and a["requests"]["none"] >= 1
    assert abs(sum(a["hit_rate"].values()) - 1) < 1e-9
    assert a["tenants"] == {tenants.tag(SALT_A)[:8]: 1, tenants.tag(SALT_B)[:8]: 1}
    assert view["ram"]["entries"] == 1 and view["ram"]["bytes"] > 0


def test_no_response_holds_prompt_text(served):
    server, _, _ = served
    bodies = [call(server, "GET", p)[2] for p in ("/v1/cache", "/cache")]
    bodies += [call(server, "DELETE", "/v1/cache/zz")[2], call(server, "DELETE", "/v1/cache", body=b"[1]")[2]]
    assert_no_text(*bodies)
    assert json.loads(bodies[0])["entries"] > 0


# ---- the page in a real browser ------------------------------------------------------------

def test_the_page_names_no_other_origin():
    assert "http:" not in page.HTML and "https:" not in page.HTML and "//" not in page.HTML
    assert "<script src" not in page.HTML and "<link" not in page.HTML and "@import" not in page.HTML


class _DOM(html.parser.HTMLParser):
    """Every element's tag and attributes, in order."""

    def __init__(self, text):
        super().__init__()
        self.elements = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def by_id(self, name):
        return next(a for _, a in self.elements if a.get("id") == name)

    def select(self, tag, cls=None, attr=None):
        return [a for t, a in self.elements if t == tag and (cls is None or cls in a.get("class", "").split())
                and (attr is None or attr in a)]


def chromium():
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium binary on PATH (apt-get install chromium; .ci/run installs it)")


def browse(tmp_path, url, *args):
    cmd = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", *args, url]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def same_numbers(dom, view):
    """Asserts that the rendered page shows view's numbers."""
    assert dom.by_id("status").get("data-state") == "ok"
    for name, key in (("entries", "entries"), ("bytes", "bytes"), ("budget-bytes", "budget_bytes"),
                      ("pinned-bytes", "pinned_bytes")):
        assert int(dom.by_id(name)["data-value"]) == view[key], name
    assert abs(float(dom.by_id("budget-used")["data-value"]) - view["budget_used"]) < 1e-12
    assert int(dom.by_id("pins")["data-value"]) == len(view["pins"])
    a = view["activity"]
    assert int(dom.by_id("requests")["data-value"]) == sum(a["requests"].values())
    assert int(dom.by_id("tokens-prefilled")["data-value"]) == a["tokens_prefilled"]
    shown = {c["data-source"]: int(c["data-value"]) for c in dom.select("td", "requests", "data-source")}
    assert shown == a["requests"]
    rates = {c["data-source"]: float(c["data-value"]) for c in dom.select("td", "rate", "data-source")}
    assert rates.keys() == a["hit_rate"].keys() and all(abs(rates[s] - a["hit_rate"][s]) < 1e-12 for s in rates)
    assert {r["data-model-tag"]: int(r["data-bytes"]) for r in dom.select("tr", attr="data-model-tag")} == \
        {m["tag"]: m["bytes"] for m in view["models"]}
    assert {r["data-reason"]: int(r["data-bytes"]) for r in dom.select("tr", attr="data-reason")} == view["by_reason"]
    assert [(g["data-sha"], int(g["data-blocks"])) for g in dom.select("g", "chain")] == \
        [(c["sha"], len(c["blocks"])) for c in view["chains"]]
    assert len(dom.select("rect", "block")) == sum(len(c["blocks"]) for c in view["chains"])
    assert [r["data-sha"] for r in dom.select("tr", "top")] == [t["sha"] for t in view["top"]]
    assert [r["data-source"] for r in dom.select("tr", "trace")] == [t["source"] for t in a["recent"]]
    assert {r["data-tag"]: int(r["data-requests"]) for r in dom.select("tr", "tenant")} == a["tenants"]


def comparable(view):
    """view without what changes by itself (the time, pins' time left, scores as hits decay)."""
    out = dict(view, generated_at=None)
    out["pins"] = [dict(p, ttl_left_s=None) for p in view["pins"]]
    out["top"] = [dict(t, score=None) for t in view["top"]]
    return out


def test_the_page_in_a_headless_browser_shows_what_get_cache_says(served, tmp_path):
    server, _, _ = served
    view = settled(server)
    dump = browse(tmp_path, server.url("/cache"), "--dump-dom")
    assert comparable(get_json(server)) == comparable(view)          # nothing changed meanwhile
    same_numbers(_DOM(dump), view)
    assert_no_text(dump.encode())
    shot = tmp_path / "cache-page.png"
    browse(tmp_path, server.url("/cache"), f"--screenshot={shot}", "--window-size=1280,1600")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_the_page_sends_the_token_of_its_url(token_server, tmp_path):
    server, _ = token_server
    view = settled(server, headers=BEARER)
    dom = _DOM(browse(tmp_path, server.url(f"/cache?token={TOKEN}"), "--dump-dom"))
    assert comparable(get_json(server, headers=BEARER)) == comparable(view)
    same_numbers(dom, view)
    # Without it the page does not even load.
    dump = browse(tmp_path, server.url("/cache"), "--dump-dom")
    assert "Authorization: Bearer" in dump and 'id="entries"' not in dump


# ---- DELETE ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["xyz0", "ABCD", "abc", "a" * 41, "12 4", "..%2f..", ""])
def test_a_bad_prefix_is_a_400_naming_it(served, prefix):
    server, cache, _ = served
    before = quiet(cache)
    status, _, body = call(server, "DELETE", "/v1/cache/" + prefix.replace(" ", "%20"))
    assert status == 400 and "4 to 40" in json.loads(body)["error"], body
    assert sorted(os.listdir(cache)) == before


def test_a_prefix_that_matches_nothing_is_a_404(served):
    server, cache, _ = served
    names = checkpoint_files(cache)
    prefix = next(p for p in (f"{i:04x}" for i in range(1 << 16)) if not any(n.startswith(p) for n in names))
    status, _, body = call(server, "DELETE", "/v1/cache/" + prefix)
    assert status == 404 and prefix in json.loads(body)["error"]
    assert checkpoint_files(cache) == names


def test_an_ambiguous_prefix_is_a_409_and_one_match_deletes_it(served):
    server, cache, _ = served
    a, b = colliding_texts(4, base="admin")
    with make_store(cache) as store:
        ea = store.save(a, np.arange(8), make_tensors(8, seed=1))
        eb = store.save(b, np.arange(8), make_tensors(8, seed=2))
    assert ea.sha[:4] == eb.sha[:4] and ea.sha != eb.sha
    before = quiet(cache)
    status, _, body = call(server, "DELETE", "/v1/cache/" + ea.sha[:4])
    assert status == 409 and json.loads(body)["matched"] >= 2 and "nothing was deleted" in json.loads(body)["error"]
    assert sorted(os.listdir(cache)) == before
    status, _, body = call(server, "DELETE", "/v1/cache/" + ea.sha[:12])
    assert status == 200 and json.loads(body) == {"deleted": 1}
    names = checkpoint_files(cache)
    assert ea.sha + ".kv" not in names and eb.sha + ".kv" in names
    assert call(server, "DELETE", "/v1/cache/" + eb.sha)[0] == 200


def test_deleting_a_first_block_takes_its_chain(served):
    server, cache, _ = served
    settled(server)
    chains = {root: names for root, names in chains_of(cache).items() if len(names) > 1}
    tenant = tenant_files(cache, SALT_A) | tenant_files(cache, SALT_B)
    root, names = next((r, n) for r, n in sorted(chains.items()) if r not in tenant)
    before = set(checkpoint_files(cache))
    status, _, body = call(server, "DELETE", "/v1/cache/" + root)
    assert status == 200 and json.loads(body) == {"deleted": len(names)}
    assert set(checkpoint_files(cache)) == before - {n + ".kv" for n in names}


def test_a_deleted_checkpoint_does_not_come_back_from_ram(model_dir, workdir):
    # RAM holds the conversation whose chain is deleted; without dropping
    # that RAM entry, the shutdown would store it again under the same names.
    cache = os.path.join(workdir, "cache-admin-ram")
    server = kvstore_server(model_dir, cache, workdir, "admin-ram", "--admin", "--prompt-cache-size", "1")
    try:
        assert chat(server, messages("collections"))["source"] == "none"
        settled(server)
        [(root, names)] = [(r, n) for r, n in chains_of(cache).items() if len(n) > 1]
        status, _, body = call(server, "DELETE", "/v1/cache/" + root)
        assert status == 200 and json.loads(body)["deleted"] == len(names)
    finally:
        assert server.stop() == 0             # SIGTERM: every RAM entry left is stored as `shutdown`
    assert "kvstore: shutdown queued=0" in server.text()
    assert not {n + ".kv" for n in names} & set(checkpoint_files(cache))


@pytest.mark.parametrize("body, message", [
    ({"cache_salt": ""}, "must not be empty"), ({"cache_salt": 5}, "must be a string"),
    ({"cache_salt": None}, "not null"), ({"salt": SALT_A}, "'salt'"), (b"not json", "not JSON"),
    ([SALT_A], "list"), ({"cache_salt": SALT_A, "all": True}, "'all'"),
])
def test_a_bad_tenant_delete_is_a_400_and_deletes_nothing(served, body, message):
    server, cache, _ = served
    before = quiet(cache)
    status, _, answer = call(server, "DELETE", "/v1/cache", body=body)
    assert status == 400 and message in json.loads(answer)["error"], answer
    assert sorted(os.listdir(cache)) == before
    assert_no_text(answer)


def test_a_tenant_delete_takes_that_tenants_files_and_ram_only(served):
    server, cache, _ = served
    chat(server, messages("logging"), SALT_A)       # RAM (one entry) now holds tenant A's prompt
    settled(server)
    mine, theirs = tenant_files(cache, SALT_A), tenant_files(cache, SALT_B)
    assert mine and theirs
    before = set(checkpoint_files(cache))
    status, _, body = call(server, "DELETE", "/v1/cache", body={"cache_salt": SALT_A})
    assert status == 200 and json.loads(body) == {"deleted": len(mine), "ram_dropped": 1}, body
    assert set(checkpoint_files(cache)) == before - {n + ".kv" for n in mine}
    assert tenant_files(cache, SALT_B) == theirs
    assert_no_text(body)
    # Neither RAM nor disk has tenant A's prefix now; it is stored again as it is used.
    assert chat(server, messages("logging"), SALT_A)["source"] == "none"
    deadline = time.monotonic() + 60
    while not tenant_files(cache, SALT_A):
        assert time.monotonic() < deadline, "tenant A's prompt was not stored again"
        time.sleep(0.3)


def test_delete_without_a_salt_takes_every_checkpoint(served):
    server, cache, _ = served
    settled(server)
    n = len(checkpoint_files(cache))
    assert n > 0
    status, _, body = call(server, "DELETE", "/v1/cache")
    assert status == 200 and json.loads(body)["deleted"] == n
    assert checkpoint_files(cache) == []
    view = get_json(server)
    assert view["entries"] == 0 and view["bytes"] == 0 and view["pins"] == [] and view["chains"] == []
    assert chat(server, messages("json"))["source"] == "none"


# ---- the store's part: its text compared where it lies ------------------------------------------

@pytest.mark.parametrize("layout", ["chain", "whole"])
def test_starts_with_compares_a_sequences_stored_text_from_its_first_block(tmp_path, layout):
    mine, theirs = (tenants.key_prefix(tenants.tag(s)) for s in (SALT_A, SALT_B))
    text = mine + bytes(range(97, 123)) * 24                 # 624 bytes: one per token
    n = len(text) - len(mine)
    with make_store(tmp_path / "s", layout=layout, block_tokens=256) as store:
        last = store.save(text, np.arange(n), make_tensors(n), positional={"k": 1, "v": 1},
                          text_offsets=[len(mine) + i for i in range(n + 1)])
        if layout == "chain":
            assert last.is_block and last.parent and last.text_start > len(mine)    # its own text is not the head
        assert store.starts_with(last, mine) and not store.starts_with(last, theirs)
        assert store.starts_with(last, text) and not store.starts_with(last, text + b"!")
        assert not store.starts_with(last, b"x" + mine)
