"""The cache page of kvstore serve (GET /cache): GET /v1/cache drawn for a person.

One self-contained HTML page: inline CSS, an inline script and inline SVG;
it names no other origin and fetches nothing but /v1/cache from its own
server (its Content-Security-Policy says so too: the script is allowed by
its hash, connections only to 'self').  The script renders the JSON every
REFRESH_S seconds: budget use, the hit rate by source over the server's
lifetime, bytes by model and by reason, the longest chains as a picture (a
row per sequence, a box per block, darker for more hits), the most valuable
sequences, pins, recent requests with their trace, and tenants (tags).
Opened as /cache?token=TOKEN it sends the token as an Authorization header.

Every number it shows carries a stable id or data attribute (the value
unformatted in data-value) so that a test can read it back: #entries,
#bytes, #budget-bytes, #budget-used, #pinned-bytes, #pins, #ram-bytes,
#ram-entries, #requests, #tokens-prefilled; td[data-source] in the sources
table (class requests, rate, reused); tr[data-model-tag], tr[data-reason],
g.chain[data-sha], tr.top[data-sha], tr.pin[data-sha], tr.trace[data-source],
tr.tenant[data-tag]; #status has data-state "ok" once rendered.
"""

import base64
import hashlib

# How often the page reloads /v1/cache.
REFRESH_S = 5

_SCRIPT = r"""
"use strict";
const REFRESH_MS = @REFRESH@ * 1000;
const token = new URLSearchParams(location.search).get("token");
const $ = (id) => document.getElementById(id);
const SOURCES = ["ram", "disk", "remote", "none"];
const SOURCE_NAMES = {ram: "RAM", disk: "disk", remote: "bucket", none: "none (prefilled)"};
const COLORS = {ram: "#3b82f6", disk: "#10b981", remote: "#f59e0b", none: "#cbd5e1"};

function esc(s) {
  const names = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  return String(s).replace(/[&<>"']/g, (c) => names[c]);
}
function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}
function pct(x) {
  if (x === null || x === undefined) return "-";
  return (100 * x).toFixed(x > 0 && x < 0.01 ? 2 : 1) + "%";
}
function num(n) { return Number(n).toLocaleString("en-US"); }
function setValue(id, text, value) { const el = $(id); el.textContent = text; el.dataset.value = value; }
function cell(text, attrs) {
  const td = document.createElement("td");
  td.textContent = text;
  for (const [k, v] of Object.entries(attrs || {})) td.setAttribute(k, v);
  return td;
}
function fill(id, rows) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...rows);
  $(id).classList.toggle("empty", rows.length === 0);
}
function row(cls, data, cells) {
  const tr = document.createElement("tr");
  if (cls) tr.className = cls;
  for (const [k, v] of Object.entries(data)) tr.setAttribute("data-" + k, v);
  tr.replaceChildren(...cells);
  return tr;
}
function bar(share, color) {
  const td = document.createElement("td");
  td.className = "barcell";
  td.innerHTML = '<svg viewBox="0 0 100 10" preserveAspectRatio="none" class="bar"><rect width="100" height="10" ' +
    'fill="#eef2f7"/><rect width="' + Math.max(0, Math.min(100, 100 * share)).toFixed(2) + '" height="10" fill="' +
    color + '"/></svg>';
  return td;
}

function renderSummary(d) {
  setValue("entries", num(d.entries), d.entries);
  setValue("bytes", fmtBytes(d.bytes), d.bytes);
  setValue("budget-bytes", d.budget_bytes ? fmtBytes(d.budget_bytes) : "none", d.budget_bytes);
  setValue("budget-used", pct(d.budget_used), d.budget_used === null ? "" : d.budget_used);
  setValue("pinned-bytes", fmtBytes(d.pinned_bytes), d.pinned_bytes);
  setValue("pins", d.pins.length + " live pin" + (d.pins.length === 1 ? "" : "s"), d.pins.length);
  const ram = d.ram || {entries: 0, bytes: 0};
  setValue("ram-bytes", fmtBytes(ram.bytes), ram.bytes);
  setValue("ram-entries", ram.entries + " entr" + (ram.entries === 1 ? "y" : "ies"), ram.entries);
  $("layout").textContent = d.layout + " layout, " + d.block_tokens + "-token blocks, model " + d.model_tag;
  const W = 1000, budget = d.budget_bytes || Math.max(d.bytes, 1);
  const used = Math.min(1, d.bytes / budget), pinned = Math.min(1, d.pinned_bytes / budget);
  $("budget-bar").innerHTML = '<svg viewBox="0 0 ' + W + ' 26" class="wide"><rect width="' + W +
    '" height="26" rx="4" fill="#eef2f7"/><rect width="' + (W * used).toFixed(1) + '" height="26" rx="4" fill="' +
    (d.budget_used !== null && d.budget_used > 0.95 ? "#ef4444" : "#3b82f6") + '"/><rect width="' +
    (W * pinned).toFixed(1) + '" height="26" rx="4" fill="#1e3a8a"/></svg>';
}

function renderSources(a) {
  const total = SOURCES.reduce((s, k) => s + a.requests[k], 0);
  setValue("requests", num(total), total);
  setValue("tokens-prefilled", num(a.tokens_prefilled), a.tokens_prefilled);
  $("since").textContent = "since " + new Date(a.since * 1000).toLocaleString();
  fill("sources", SOURCES.map((s) => row("source", {source: s}, [
    cell(SOURCE_NAMES[s]),
    cell(num(a.requests[s]), {"class": "requests n", "data-source": s, "data-value": a.requests[s]}),
    cell(pct(a.hit_rate[s]), {"class": "rate n", "data-source": s, "data-value": a.hit_rate[s]}),
    bar(a.hit_rate[s], COLORS[s]),
    cell(s === "none" ? "-" : num(a.tokens_reused[s]),
         {"class": "reused n", "data-source": s, "data-value": s === "none" ? 0 : a.tokens_reused[s]}),
  ])));
  let x = 0, svg = '<svg viewBox="0 0 1000 26" class="wide">';
  for (const s of SOURCES) {
    const w = total ? 1000 * a.requests[s] / total : 0;
    svg += '<rect x="' + x.toFixed(1) + '" width="' + w.toFixed(1) + '" height="26" fill="' + COLORS[s] +
      '"><title>' + esc(SOURCE_NAMES[s]) + ": " + pct(a.hit_rate[s]) + "</title></rect>";
    x += w;
  }
  $("hit-bar").innerHTML = svg + (total ? "" : '<text x="8" y="18" fill="#64748b">no requests yet</text>') + "</svg>";
}

function renderShares(d) {
  const most = Math.max(1, ...d.models.map((m) => m.bytes));
  fill("models", d.models.map((m) => row("model", {"model-tag": m.tag, bytes: m.bytes, entries: m.entries}, [
    cell(m.name + (m.tag === d.model_tag ? " (this server)" : "")), cell(m.tag), cell(num(m.entries), {"class": "n"}),
    cell(fmtBytes(m.bytes), {"class": "n"}), bar(m.bytes / most, "#6366f1")])));
  const reasons = Object.entries(d.by_reason);
  const top = Math.max(1, ...reasons.map((r) => r[1]));
  fill("reasons", reasons.map(([name, b]) => row("reason", {reason: name, bytes: b}, [
    cell(name), cell(fmtBytes(b), {"class": "n"}), bar(b / top, "#0ea5e9")])));
}

function renderChains(chains) {
  const LABEL = 210, W = 1200, H = 24, GAP = 6;
  const most = Math.max(1, ...chains.map((c) => c.tokens));
  const scale = (W - LABEL - 10) / most;
  let svg = '<svg viewBox="0 0 ' + W + " " + Math.max(1, chains.length * (H + GAP)) + '" class="wide chains">';
  chains.forEach((c, i) => {
    const y = i * (H + GAP);
    svg += '<g class="chain" data-sha="' + esc(c.sha) + '" data-tokens="' + c.tokens + '" data-blocks="' +
      c.blocks.length + '" data-bytes="' + c.bytes + '"><text x="0" y="' + (y + 16) + '" class="mono">' +
      esc(c.sha) + " " + num(c.tokens) + " tok</text>";
    let x = LABEL;
    c.blocks.forEach((b, j) => {
      const w = Math.max(1.5, b.tokens * scale), light = Math.max(30, 82 - 22 * Math.log2(1 + b.hits));
      const hue = c.whole ? 28 : 215;
      svg += '<rect class="block" x="' + x.toFixed(1) + '" y="' + y + '" width="' + Math.max(0.5, w - 1).toFixed(1) +
        '" height="' + H + '" rx="2" fill="hsl(' + hue + ',70%,' + light.toFixed(0) + '%)"><title>block ' + (j + 1) +
        ": " + num(b.tokens) + " tokens, " + fmtBytes(b.bytes) + ", " + b.hits + " hits</title></rect>";
      x += w;
    });
    svg += "</g>";
  });
  $("chains").innerHTML = chains.length ? svg + "</svg>" : '<p class="muted">nothing stored yet</p>';
}

function renderTables(d) {
  fill("top", d.top.map((t) => row("top", {sha: t.sha, tokens: t.tokens, bytes: t.bytes}, [
    cell(t.sha, {"class": "mono"}), cell(num(t.tokens), {"class": "n"}), cell(t.blocks, {"class": "n"}),
    cell(fmtBytes(t.bytes), {"class": "n"}), cell(t.hits, {"class": "n"}), cell(t.reason),
    cell(t.score.toPrecision(3), {"class": "n"})])));
  fill("pin-table", d.pins.map((p) => row("pin", {sha: p.sha, bytes: p.bytes}, [
    cell(p.sha, {"class": "mono"}), cell(num(p.tokens), {"class": "n"}), cell(fmtBytes(p.bytes), {"class": "n"}),
    cell(Math.round(p.ttl_left_s / 60) + " min", {"class": "n"}), cell(p.tenant || "-", {"class": "mono"})])));
  const a = d.activity;
  fill("recent", a.recent.map((t) => row("trace", {source: t.source, prefilled: t.prefilled_tokens}, [
    cell(new Date(t.at * 1000).toLocaleTimeString()), cell(t.tenant || "-", {"class": "mono"}), cell(t.source),
    cell(num(t.reused_tokens.ram), {"class": "n"}), cell(num(t.reused_tokens.disk), {"class": "n"}),
    cell(num(t.reused_tokens.bucket), {"class": "n"}), cell(num(t.prefilled_tokens), {"class": "n"}),
    cell(t.load_ms.toFixed(1), {"class": "n"}),
    cell((t.stored || []).map((s) => (s.kind || s.reason) + ":" + s.tokens).join(" ") || "-"),
    cell((t.pins || []).map((p) => p.tokens + ":" + p.state).join(" ") || "-")])));
  fill("tenants", Object.entries(a.tenants).map(([tag, n]) => row("tenant", {tag: tag, requests: n}, [
    cell(tag, {"class": "mono"}), cell(num(n), {"class": "n"})])));
}

function render(d) {
  renderSummary(d);
  renderSources(d.activity);
  renderShares(d);
  renderChains(d.chains);
  renderTables(d);
  $("updated").textContent = "updated " + new Date(d.generated_at * 1000).toLocaleTimeString();
  $("status").textContent = "live";
  $("status").dataset.state = "ok";
}

async function load() {
  try {
    const r = await fetch("/v1/cache", {cache: "no-store", headers: token ? {"Authorization": "Bearer " + token} : {}});
    const body = await r.json();
    if (!r.ok) throw new Error(r.status + ": " + (body.error || r.statusText));
    render(body);
  } catch (e) {
    $("status").textContent = String(e.message || e);
    $("status").dataset.state = "error";
  }
  setTimeout(load, REFRESH_MS);
}
load();
"""

_STYLE = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #0f172a;
       background: #f8fafc; }
header { display: flex; gap: 16px; align-items: baseline; padding: 14px 24px; background: #0f172a; color: #f8fafc; }
header h1 { font-size: 20px; margin: 0; }
header .muted { color: #94a3b8; }
#status { padding: 1px 8px; border-radius: 9px; background: #475569; }
#status[data-state="ok"] { background: #059669; }
#status[data-state="error"] { background: #dc2626; }
main { padding: 8px 24px 24px; max-width: 1240px; }
h2 { font-size: 16px; margin: 22px 0 8px; }
h2 small { font-weight: normal; color: #64748b; }
.cards { display: grid; grid-template-columns: repeat(6, 1fr); gap: 10px; margin-top: 14px; }
.card { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 10px 12px; }
.card .k { color: #64748b; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 600; }
.card .sub { color: #64748b; font-size: 12px; }
.two { display: grid; grid-template-columns: 1fr 1fr; gap: 24px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #e2e8f0; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #f1f5f9; white-space: nowrap; }
th { background: #f1f5f9; font-weight: 600; font-size: 12px; color: #334155; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
.mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.barcell { width: 30%; }
svg.bar { width: 100%; height: 10px; display: block; }
svg.wide { width: 100%; height: auto; display: block; margin: 6px 0; }
svg.chains text { font-size: 13px; fill: #334155; }
table.empty tbody::after { content: "none"; display: block; padding: 4px 8px; color: #94a3b8; }
.muted { color: #64748b; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; border-radius: 2px; }
footer { color: #94a3b8; font-size: 12px; padding: 0 24px 20px; }
"""

_BODY = """
<header><h1>kvstore cache</h1><span id="status" data-state="loading">loading</span>
<span id="updated" class="muted"></span><span id="layout" class="muted"></span></header>
<main>
<section class="cards">
<div class="card"><div class="k">entries</div><div class="v" id="entries">-</div>
  <div class="sub">checkpoint files</div></div>
<div class="card"><div class="k">on disk</div><div class="v" id="bytes">-</div>
  <div class="sub">every model</div></div>
<div class="card"><div class="k">budget</div><div class="v" id="budget-bytes">-</div>
  <div class="sub">--budget-mb</div></div>
<div class="card"><div class="k">budget used</div><div class="v" id="budget-used">-</div>
  <div class="sub">of the budget</div></div>
<div class="card"><div class="k">pinned</div><div class="v" id="pinned-bytes">-</div>
  <div class="sub" id="pins">-</div></div>
<div class="card"><div class="k">RAM cache</div><div class="v" id="ram-bytes">-</div>
  <div class="sub" id="ram-entries">-</div></div>
</section>
<div id="budget-bar"></div>
<div class="legend muted"><span><i style="background:#3b82f6"></i>used</span>
<span><i style="background:#1e3a8a"></i>pinned</span><span><i style="background:#eef2f7"></i>free</span></div>

<h2>Where prompts came from <small id="since"></small></h2>
<div id="hit-bar"></div>
<table id="sources"><thead><tr><th>source</th><th class="n">requests</th><th class="n">share</th><th></th>
<th class="n">tokens reused</th></tr></thead><tbody></tbody></table>
<p class="muted">requests served: <b id="requests">-</b>; tokens prefilled: <b id="tokens-prefilled">-</b></p>

<section class="two">
<div><h2>Bytes by model</h2><table id="models"><thead><tr><th>model</th><th>tag</th><th class="n">files</th>
<th class="n">bytes</th><th></th></tr></thead><tbody></tbody></table></div>
<div><h2>Bytes by reason</h2><table id="reasons"><thead><tr><th>reason</th><th class="n">bytes</th><th></th></tr>
</thead><tbody></tbody></table></div>
</section>

<h2>Longest stored sequences <small>a row per sequence, a box per block (width: tokens; darker: more hits;
orange: a whole file)</small></h2>
<div id="chains"></div>

<h2>Most valuable sequences <small>eviction score: the lowest goes first</small></h2>
<table id="top"><thead><tr><th>file</th><th class="n">tokens</th><th class="n">blocks</th><th class="n">bytes</th>
<th class="n">hits</th><th>reason</th><th class="n">score</th></tr></thead><tbody></tbody></table>

<h2>Pins</h2>
<table id="pin-table"><thead><tr><th>file</th><th class="n">tokens</th><th class="n">bytes kept</th>
<th class="n">left</th><th>tenant</th></tr></thead><tbody></tbody></table>

<h2>Recent requests</h2>
<table id="recent"><thead><tr><th>done</th><th>tenant</th><th>source</th><th class="n">RAM</th><th class="n">disk</th>
<th class="n">bucket</th><th class="n">prefilled</th><th class="n">load ms</th><th>stored</th><th>pins</th></tr></thead>
<tbody></tbody></table>

<h2>Tenants <small>requests by cache_salt tag</small></h2>
<table id="tenants"><thead><tr><th>tag</th><th class="n">requests</th></tr></thead><tbody></tbody></table>
</main>
<footer>kvstore serve: numbers, file names and tags only, never prompt text; refreshes every @REFRESH@ s.</footer>
"""

_SCRIPT = _SCRIPT.replace("@REFRESH@", str(REFRESH_S))

HTML = ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<meta name=\"referrer\" content=\"no-referrer\"><title>kvstore cache</title>"
        f"<style>{_STYLE}</style></head><body>{_BODY.replace('@REFRESH@', str(REFRESH_S))}"
        f"<script>{_SCRIPT}</script></body></html>\n")

# The page's headers: its script runs by its hash, it connects only to its
# own server, and it sends no Referer (a URL with ?token= stays here).
HEADERS = (
    ("Content-Security-Policy",
     "default-src 'none'; script-src 'sha256-" + base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
     + "'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
)

__all__ = ["HTML", "HEADERS", "REFRESH_S"]
