"""End to end with a real MLX model: MLXEngine + PromptCache + KVStore.

The model is a random-weight mlx-lm llama (kvstore/demo/model.py) and the
tokenizer a byte-level BPE with chat markers trained offline on Python's own
docstrings, so merges are long and multi-byte characters split into byte
tokens, as with real BPE vocabularies.  The model is tiny (2 layers, one KV
head) because MLX's CPU wheel uses a reference BLAS: a cold prefill of the
6,844-token prompt below still takes a few seconds.

What is checked:

1. a state restored from disk at an aligned boundary and prefilled with the
   same step gives logits bit-identical to a cold prefill, and the same greedy
   tokens;
2. a stored text whose boundary falls inside a token of the whole prompt: the
   effective prompt is the stored tokens + the tokens of the text suffix, and
   prefilling it equals a cold prefill of that token list; multi-byte
   characters around the boundaries are never cut;
3. the store policy of docs/semantics.md §7 over a scripted chat of two users;
4. a model directory loaded with mlx_lm.load works end to end.

Where logits or greedy tokens are compared, both sides are prefilled with the
same chunk boundaries: MLX does not promise bit-identical results for other
chunkings (on some back ends a different matmul shape reorders the sums;
tests/backend.py says what the tests assume of the backend).
"""

import logging
import os
from collections import Counter

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import backend  # noqa: E402

import kvstore  # noqa: E402
from kvstore import policy  # noqa: E402
from kvstore.settings import Settings  # noqa: E402
import kvstore.mlx  # noqa: E402
from kvstore.mlx import MLXEngine, save_prompt_cache  # noqa: E402
from kvstore.prompt_cache import PromptCache  # noqa: E402

from kvstore.demo import model as mlx_model  # noqa: E402
from kvhelpers import checkpoint_files, make_store, stored  # noqa: E402
from kvstore.format import read_entry  # noqa: E402

# One model for the whole file.  Prefill cost on this CPU is dominated by the
# attention, which grows with heads x head_dim: 2 query heads sharing one KV
# head (grouped-query attention, as in most served models) of 16 dims.
MODEL = dict(seed=0, layers=2, hidden=64, heads=2, kv_heads=1, head_dim=16)

# Test 1 uses ds4's prefill step and alignment; the others a 64-token grid so
# that chats of a few hundred tokens cross several boundaries.
BIG_STEP = 2048
STEP = 64
SMALL = Settings(min_tokens=64, cold_max_tokens=30000, continued_interval_tokens=256,
                        boundary_trim_tokens=8, boundary_align_tokens=64)
GEN_TOKENS = 8


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def model():
    return mlx_model.make_model(**MODEL)


PROSE_MODULES = ("argparse", "collections", "email.message", "http.client", "json", "logging",
                 "pathlib", "subprocess", "threading", "unittest")


@pytest.fixture(scope="module")
def prose():
    """English text without chat markers: docstrings of standard modules (ASCII only)."""
    return mlx_model.prose(PROSE_MODULES)


def text_of_tokens(tok, text, n):
    """The shortest prefix of text (whole characters) that tokenizes to exactly n tokens."""
    p = mlx_model.text_of_tokens(tok, text, n)
    assert p is not None, f"no prefix of exactly {n} tokens (or not enough text)"
    return p


def chunk_ends(start, stop, step, extra=()):
    """Where a prefill of tokens [start, stop) ends its chunks: absolute multiples of
    step, the extra cut points (a cold anchor) inside the range, and stop."""
    ends = {e for e in range((start // step + 1) * step, stop, step)}
    ends |= {e for e in extra if start < e < stop}
    return sorted(ends | {stop})


def prefill_at(engine, tokens, ends):
    """Cold prefill of tokens in a fresh state, one chunk per end; the last logits."""
    engine.reset()
    start, logits = 0, None
    for end in ends:
        logits = engine.prefill(tokens[start:end])
        start = end
    assert start == len(tokens)
    return logits


def model_store(path, model, **kw):
    """make_store for the state of model (its fingerprint names every file)."""
    return make_store(path, model_identity=kvstore.mlx.model_fingerprint(model), **kw)


same = backend.same_array


class RecordingEngine(MLXEngine):
    """An MLXEngine that keeps the logits of every prefill call, decode steps included."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.logits = []

    def prefill(self, tokens):
        out = super().prefill(tokens)
        self.logits.append(out)
        return out


def same_steps(a, b):
    """Two lists of logits, equal bit for bit."""
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def whole_chars(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---------------------------------------------------------------- 1. restore equals recompute

def test_disk_hit_at_an_aligned_boundary_equals_a_cold_prefill(tok, model, prose, tmp_path):
    n = 3 * BIG_STEP + 700
    opts = Settings(min_tokens=512)
    # A prompt whose token 6144 starts a new word, so that tokenizing the text
    # after the checkpoint alone gives the same ids as the whole prompt (test 2
    # covers the other case).
    for skip in range(0, 40 * 200, 200):
        prompt = text_of_tokens(tok, prose[skip:], n)
        tokens = tok.encode(prompt)
        cut = policy.store_len(n, opts)
        head = tok.token_bytes(tokens[:cut])
        if tokens[:cut] + tok.encode(prompt.encode()[len(head):].decode()) == tokens:
            break
    else:
        pytest.fail("no prompt with a clean token boundary at 6144")
    assert len(tokens) == n
    assert tok.user_id not in tokens and tok.assistant_id not in tokens   # no chat anchor
    assert cut == 3 * BIG_STEP

    # Cold: prefill everything, store the cold checkpoint at store_len.
    cold = RecordingEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=opts) as store:
        pc = PromptCache(store, cold, prefill_step=BIG_STEP)
        cold_out, rep = cold.generate(pc, prompt, max_tokens=32)
        assert rep["source"] == "none" and rep["reused_tokens"] == 0 and rep["prefilled_tokens"] == n
        assert rep["stored"] == [("cold", cut)] and rep["ttft_ms"] > 0
        assert stored(store) == [("cold", cut)]
        assert store.find(prompt).text_bytes == len(head)

    # A new process: new KVStore on the same directory, fresh engine.
    hit = RecordingEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=opts) as store:
        pc = PromptCache(store, hit, prefill_step=BIG_STEP)
        hit_out, rep = hit.generate(pc, prompt, max_tokens=32)
        assert rep["source"] == "disk" and rep["reused_tokens"] == cut
        assert rep["prefilled_tokens"] == n - cut + 1 and rep["ttft_ms"] > 0   # the canary token again
        assert rep["stored"] == []

    # A third, fresh engine: a plain cold prefill with the same step.
    ref = prefill_at(MLXEngine(model, tok), tokens, chunk_ends(0, n, BIG_STEP))
    prompt_chunks = len(chunk_ends(0, n, BIG_STEP))
    assert len(cold.logits) == prompt_chunks + len(cold_out) - 1
    assert same(hit.logits[0], ref) and same(cold.logits[prompt_chunks - 1], ref)
    assert len(cold_out) >= 1 and hit_out == cold_out
    # Every decode step too, not only the greedy ids (a random-weight model's
    # greedy output soon repeats one token).
    assert same_steps(hit.logits[1:], cold.logits[prompt_chunks:])


# ---------------------------------------------------------------- 2. tokenization drift

def drift_cut(tok, text, min_tokens):
    """A cut inside a word where tokenizing (prefix, suffix) differs from the whole."""
    whole = tok.encode(text)
    for c in range(len(text) - 40, 0, -1):
        if not (text[c - 1].isalpha() and text[c].isalpha()):
            continue
        head = tok.encode(text[:c])
        if len(head) < min_tokens:
            break
        if head + tok.encode(text[c:]) != whole:
            return c
    raise AssertionError("no cut with tokenization drift")


@pytest.mark.parametrize("saved_by", ["prompt_cache", "save_prompt_cache"])
def test_stored_boundary_inside_a_merged_token(tok, model, prose, tmp_path, saved_by):
    # P tokenizes differently whole than as (prefix, suffix): the boundary is
    # inside a merged token of P.
    p = text_of_tokens(tok, prose[5000:], 420)
    c = drift_cut(tok, p, 300)
    prefix, suffix = p[:c], p[c:]
    prefix_tokens = tok.encode(prefix)
    with model_store(tmp_path / "kv", model, settings=SMALL) as store:
        if saved_by == "prompt_cache":
            # A session that prefilled exactly the prefix and stopped (the store
            # on close: its text is the prefix, its tokens prefix_tokens).
            pc = PromptCache(store, MLXEngine(model, tok), prefill_step=STEP)
            req = pc.begin(prefix)
            pc.prefill(req)
            cuts = [req.cold_target]           # the cold anchor also ended a chunk
            assert req.cold_target == policy.store_len(len(prefix_tokens), SMALL)
            pc.close()
            assert ("shutdown", len(prefix_tokens)) in stored(store)
        else:
            # An mlx-lm prompt cache filled outside PromptCache, saved with the API.
            cache = mlx_model.make_cache(model)
            mlx_model.prefill(model, cache, prefix_tokens, step=STEP)
            cuts = []
            assert save_prompt_cache(store, prefix, prefix_tokens, cache, model) is not None

    engine = MLXEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=SMALL) as store:
        pc = PromptCache(store, engine, prefill_step=STEP)
        req = pc.begin(p)
        assert req.source == "disk" and req.reused == len(prefix_tokens)
        effective = prefix_tokens + tok.encode(suffix)
        assert req.tokens == effective
        assert effective != tok.encode(p)                     # the drift is real
        assert tok.token_bytes(effective) == p.encode()
        logits = pc.prefill(req)
    ends = chunk_ends(0, len(prefix_tokens), STEP, cuts) + \
        chunk_ends(len(prefix_tokens), len(effective), STEP)
    assert same(logits, prefill_at(MLXEngine(model, tok), effective, ends))


MULTI_BYTE = ["café", "prix: 12 €", "naïve", "😀", "Grüße", "中文", "déjà vu", "🚀🚀", "½", "ñ"]


def multi_byte_text(prose, start, words):
    """Prose with a multi-byte word after every `words` words (deterministic)."""
    out = []
    for i, w in enumerate(prose[start:].split(" ")[:words * 200]):
        out.append(w)
        if i % words == words - 1:
            out.append(MULTI_BYTE[(i // words) % len(MULTI_BYTE)])
    return " ".join(out)


def test_multi_byte_characters_are_never_cut(tok, model, prose, tmp_path, caplog):
    # Waypoints every 64 tokens; multi-byte characters split into byte tokens,
    # so some of those frontiers fall inside a character.
    opts = Settings(min_tokens=64, continued_interval_tokens=64, boundary_trim_tokens=8,
                           boundary_align_tokens=64)
    q = text_of_tokens(tok, multi_byte_text(prose, 9000, 3), 600)
    tokens = tok.encode(q)
    n = len(tokens)
    cold_target = policy.store_len(n, opts)
    candidates = sorted({k for k in range(64, n + 1, 64)} | {cold_target})
    whole = [k for k in candidates if whole_chars(tok.token_bytes(tokens[:k]))]
    cut = [k for k in candidates if k not in whole]
    assert whole and cut, "the prompt must put some boundaries inside characters"

    caplog.set_level(logging.INFO, logger="kvstore")
    with model_store(tmp_path / "kv", model, settings=opts) as store:
        pc = PromptCache(store, MLXEngine(model, tok), prefill_step=STEP)
        pc.prefill(pc.begin(q))
        assert sorted(e.tokens for e in store.entries()) == whole
        for e in store.entries():
            ckpt = store.load(e, into="numpy")
            assert whole_chars(ckpt.text_bytes)
            assert list(ckpt.tokens) == tokens[:e.tokens]
    # One skipped attempt per waypoint frontier inside a character, and one for
    # the cold cut there (a failed cold store leaves the waypoint to be tried).
    attempts = [k for k in range(64, n + 1, 64) if k in cut] + [cold_target] * (cold_target in cut)
    assert caplog.text.count("store_skipped reason=mid_character") == len(attempts)

    # A longer prompt that puts multi-byte characters right after the stored
    # text: a disk hit at the longest checkpoint, suffix tokenized on its own.
    q2 = q + "€😀 " + multi_byte_text(prose, 20000, 2)[:300]
    engine = MLXEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=opts) as store:
        pc = PromptCache(store, engine, prefill_step=STEP)
        req = pc.begin(q2)
        k = max(whole)
        assert req.source == "disk" and req.reused == k
        head = tok.token_bytes(tokens[:k])
        assert req.tokens == tokens[:k] + tok.encode(q2.encode()[len(head):].decode())
        assert tok.token_bytes(req.tokens) == q2.encode()
        logits = pc.prefill(req)
        ends2 = chunk_ends(0, k, STEP, [cold_target]) + chunk_ends(k, len(req.tokens), STEP)
        assert same(logits, prefill_at(MLXEngine(model, tok), req.tokens, ends2))

        # The engine generates the first byte of a 4-byte character: the live
        # text now ends inside it.  The next prompt holds the whole character;
        # the live session is still reused, up to the last whole character.
        t0 = tok.encode("😀")[0]
        engine.prefill([t0])
        pc.extend([t0])
        n2 = len(req.tokens)
        q3 = q2 + "😀 and then some more words."
        req3 = pc.begin(q3)
        assert req3.source == "memory" and req3.reused == n2
        assert req3.tokens == req.tokens + tok.encode("😀 and then some more words.")
        logits3 = pc.prefill(req3)
    ends3 = ends2 + chunk_ends(n2, len(req3.tokens), STEP)
    assert same(logits3, prefill_at(MLXEngine(model, tok), req3.tokens, ends3))


# ---------------------------------------------------------------- 3. the policy on a chat

# Sizes that make the script cross the policy's frontiers (waypoints every
# 256 tokens): the anchor (about 335) lies past the first waypoint; A's turns
# (about 430, 540, 650 tokens) cross 512 on a memory hit; B's (about 540, 750,
# 960) cross 512 after the hit at the anchor and 768 on a memory hit.
SYSTEM_PROMPT_TOKENS = 330
QUESTION_TOKENS = (90, 200)             # user A's, user B's


def turn_prompt(tok, system, turns):
    """The chat rendering: system, then alternating user / assistant turns, then the
    assistant marker (the generation prompt)."""
    msgs = [{"role": "system", "content": system}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return tok.render_chat(msgs)


def test_chat_policy_two_users(tok, model, prose, tmp_path):
    system = text_of_tokens(tok, prose[30000:], SYSTEM_PROMPT_TOKENS)
    q = [text_of_tokens(tok, prose[40000 + 2000 * i:], QUESTION_TOKENS[i // 3]) for i in range(6)]
    answer = ["Noted; here is the plan.", "Done, see above.", "Yes.", "Here it is."]
    a_turns = [[q[0]], [q[0], answer[0], q[1]], [q[0], answer[0], q[1], answer[1], q[2]]]
    b_turns = [[q[3]], [q[3], answer[2], q[4]], [q[3], answer[2], q[4], answer[3], q[5]]]
    a = [turn_prompt(tok, system, t) for t in a_turns]
    b = [turn_prompt(tok, system, t) for t in b_turns]
    script = [("A1", a[0]), ("A2", a[1]), ("B1", b[0]), ("A3", a[2]), ("B2", b[1]), ("B3", b[2])]

    engine = RecordingEngine(model, tok, user_marker="<|user|>", assistant_marker="<|assistant|>")
    assert (engine.user_id, engine.assistant_id) == (tok.user_id, tok.assistant_id)
    store = model_store(tmp_path / "kv", model, settings=SMALL)
    pc = PromptCache(store, engine, prefill_step=STEP)

    def expected_stores(start, end, last, cold_target):
        """docs/semantics.md §7 from kvstore.policy alone: what a prefill of [start, end) stores."""
        out = []
        for pos in chunk_ends(start, end, STEP, [cold_target] if cold_target else []):
            if cold_target and pos == cold_target:
                out.append(("cold", pos))          # an anchor on a frontier suppresses the waypoint
                last = max(last, pos)
            elif policy.continued_store_target(pos, last, SMALL) == pos:
                out.append(("continued", pos))
                last = pos
        return out, last

    def effective_prompt(reused, prompt):
        """The reused exact tokens + the tokens of only the text after them."""
        return reused + tok.encode(prompt.encode()[len(tok.token_bytes(reused)):].decode())

    # The replies are the script's, not the model's: the caller renders them
    # its own way, so generated tokens leave the live session (keep_generated).
    reports, outs, steps, evicted = {}, {}, {}, []
    live, last, anchor, live_user, owners = [], 0, None, None, []
    session = {}            # user -> the exact tokens of their last request
    for name, prompt in script:
        ids = tok.encode(prompt)
        user = name[0]
        before = Counter(stored(store))
        calls = len(engine.logits)
        out, rep = engine.generate(pc, prompt, max_tokens=GEN_TOKENS, keep_generated=False)
        reports[name], outs[name] = rep, out
        steps[name] = engine.logits[calls:][-len(out):]   # last prompt chunk, then each decode step
        assert rep["ttft_ms"] > 0 and rep["generated"] == len(out) >= 1

        evict = []
        if name == "A1":                       # cold; anchor: last user marker before the first assistant
            anchor = policy.chat_anchor_pos(ids, tok.user_id, tok.assistant_id, SMALL)
            assert anchor == ids.index(tok.user_id) >= SMALL.min_tokens
            assert rep["source"] == "none" and rep["reused_tokens"] == 0
            effective = ids
            exp, last = expected_stores(0, len(ids), 0, anchor)
        elif name == "B1":                     # disk hit at A's anchor: the shared system prompt
            assert ids[:anchor] == tok.encode(a[0])[:anchor]
            assert rep["source"] == "disk" and rep["reused_tokens"] == anchor
            evict = [("evict", len(live))]     # A's live session, replaced by the load
            effective = effective_prompt(ids[:anchor], prompt)
            exp, last = expected_stores(anchor, len(effective), anchor, 0)
        elif name in ("A3", "B2"):             # disk hit at the user's own evict checkpoint
            own = session[user]
            assert rep["source"] == "disk" and rep["reused_tokens"] == len(own)
            evict = [("evict", len(live))]     # the other user's live session
            effective = effective_prompt(own, prompt)
            exp, last = expected_stores(len(own), len(effective), len(own), 0)
        else:                                  # A2, B3: a follow-up while the live session is theirs
            assert rep["source"] == "memory" and rep["reused_tokens"] == len(live)
            effective = effective_prompt(live, prompt)
            exp, last = expected_stores(len(live), len(effective), last, 0)
        assert effective == ids                # every boundary here is at a marker or a turn end
        # A disk hit recomputes its last token (the canary) with the rest.
        assert rep["prefilled_tokens"] == len(effective) - rep["reused_tokens"] + (rep["canary"] == "tail")
        assert rep["canary"] == ("tail" if rep["source"] == "disk" else "")
        assert rep["stored"] == exp, name
        assert Counter(stored(store)) - before == Counter(exp + evict), name     # new files
        assert pc.live_tokens == effective
        evicted += evict
        owners += [live_user] * len(evict)
        live, live_user = effective, user
        session[user] = effective

    pc.close()                                 # shutdown: the live session (B's)
    # In a chain, an evict state is a tail that goes once its user's sequence
    # fills the block it lay in (a grid-aligned store past it, docs/format.md
    # §14); a whole-file checkpoint is no tail and stays.
    grid = store.settings.block_tokens
    replaced = [(o, e) for o, e in zip(owners, evicted)
                if any(t % grid == 0 and t >= (e[1] // grid + 1) * grid
                       for n, r in reports.items() if n[0] == o for _, t in r["stored"])]
    assert replaced == [("B", ("evict", 541))]
    if store.settings.layout != "chain":
        replaced = []
    kept = [e for o, e in zip(owners, evicted) if (o, e) not in replaced]
    expected_all = [s for r in reports.values() for s in r["stored"]] + kept + [("shutdown", len(live))]
    assert stored(store) == sorted(expected_all)
    assert [reports[n]["source"] for n, _ in script] == ["none", "memory", "disk", "disk", "disk", "memory"]
    assert len(evicted) == 3
    assert [r for name in ("A2", "B1", "B3") for r, _ in reports[name]["stored"]] == ["continued"] * 3
    store.close()

    # Logits and greedy tokens equal a run without a store where the prefill
    # chunks are the same: the cold request, and the disk hit at the anchor
    # (the anchor is a chunk end of the cold request that stored it).
    for name, prompt in script[:1] + script[2:3]:
        with model_store(tmp_path / f"none-{name}", model, settings=SMALL, budget_mb=1e-6) as nothing:
            ref = RecordingEngine(model, tok)
            ref_out, ref_rep = ref.generate(PromptCache(nothing, ref, prefill_step=STEP), prompt,
                                            max_tokens=GEN_TOKENS)
            assert ref_rep["source"] == "none" and nothing.entries() == []
        assert ref_out == outs[name], name
        assert same_steps(ref.logits[-len(ref_out):], steps[name]), name


# ---------------------------------------------------------------- 4. a model directory

def test_model_directory_end_to_end(tok, tmp_path):
    import mlx_lm
    built, built_tok = mlx_model.write_model_dir(tmp_path / "model", **MODEL)
    loaded, wrapper = mlx_lm.load(str(tmp_path / "model"))
    engine_kw = dict(user_marker="<|user|>", assistant_marker="<|assistant|>")
    engine = MLXEngine(loaded, wrapper, **engine_kw)
    assert (engine.user_id, engine.assistant_id) == (built_tok.user_id, built_tok.assistant_id)

    system = "You are a careful assistant for a hardware store. " * 12
    first = built_tok.render_chat([{"role": "system", "content": system},
                                   {"role": "user", "content": "Which screws hold a shelf?"}])
    second = built_tok.render_chat([{"role": "system", "content": system},
                                    {"role": "user", "content": "How long is a 6 mm drill bit?"}])
    ids = built_tok.encode(first)
    assert engine.tokenize(first.encode()) == ids
    assert engine.token_bytes(ids) == first.encode()
    anchor = policy.chat_anchor_pos(ids, built_tok.user_id, built_tok.assistant_id, SMALL)
    assert anchor > 0

    with model_store(tmp_path / "kv", loaded, settings=SMALL) as store:
        pc = PromptCache(store, engine, prefill_step=STEP)
        out1, rep1 = engine.generate(pc, first, max_tokens=GEN_TOKENS)
        assert rep1["source"] == "none" and ("cold", anchor) in rep1["stored"]

    engine2 = RecordingEngine(loaded, wrapper, **engine_kw)
    with model_store(tmp_path / "kv", loaded, settings=SMALL) as store:
        pc = PromptCache(store, engine2, prefill_step=STEP)
        out2, rep2 = engine2.generate(pc, second, max_tokens=GEN_TOKENS)
        assert rep2["source"] == "disk" and rep2["reused_tokens"] == anchor
        assert rep2["prefilled_tokens"] == len(built_tok.encode(second)) - anchor + 1     # the canary token
        assert rep2["canary"] == "tail"

    # The loaded model is the one built in code: a no-store run of the built
    # model with the test tokenizer gives the same logits at every step.
    with model_store(tmp_path / "none", built, settings=SMALL, budget_mb=1e-6) as nothing:
        ref = RecordingEngine(built, built_tok)
        ref_out, _ = ref.generate(PromptCache(nothing, ref, prefill_step=STEP), second, max_tokens=GEN_TOKENS)
    assert ref_out == out2
    assert same_steps(ref.logits[-len(ref_out):], engine2.logits[-len(out2):])


def test_a_sealed_store_restores_bit_exact(tok, tmp_path):
    # Sealed checkpoints (docs/format.md §16) restore the same state: the
    # decode after a sealed disk hit equals a cold prefill's, logit for logit.
    pytest.importorskip("cryptography")
    model = mlx_model.make_model(seed=0, layers=2, hidden=64, heads=2, kv_heads=1, head_dim=16)
    opts = Settings(min_tokens=64, boundary_trim_tokens=8, boundary_align_tokens=64)
    prompt = mlx_model.text_of_tokens(tok, mlx_model.prose(("json", "argparse")), 300)
    assert prompt is not None

    cold = RecordingEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=opts, key=bytes(range(32)), block_tokens=64) as store:
        cold_out, rep = cold.generate(PromptCache(store, cold, prefill_step=64), prompt, max_tokens=6)
        assert rep["stored"]
    assert all(read_entry(tmp_path / "kv" / n).sealed for n in checkpoint_files(tmp_path / "kv"))
    hit = RecordingEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=opts, key=bytes(range(32)), block_tokens=64) as store:
        hit_out, rep = hit.generate(PromptCache(store, hit, prefill_step=64), prompt, max_tokens=6)
        assert rep["source"] == "disk" and rep["reused_tokens"] > 0
    assert hit_out == cold_out
    # The decode steps' logits equal bit for bit.
    n = len(hit_out) - 1
    for a, b in zip(hit.logits[-n:], cold.logits[-n:]):
        assert same(a, b)
    # Without the key the same directory is a cold start.
    plain = RecordingEngine(model, tok)
    with model_store(tmp_path / "kv", model, settings=opts, block_tokens=64) as store:
        _, rep = plain.generate(PromptCache(store, plain, prefill_step=64), prompt, max_tokens=2)
        assert rep["source"] == "none"


# ---------------------------------------------------------------- 5. model identity and the canary

OTHER = dict(MODEL, seed=1)        # the same architecture and config, other weights


def cold_output(model, tok, prompt, tmp_path, name):
    """(greedy tokens, logits of every decode step) of a run that restores
    nothing (a store of its own, empty)."""
    engine = RecordingEngine(model, tok)
    with model_store(tmp_path / f"cold-{name}", model, settings=SMALL) as store:
        out, rep = engine.generate(PromptCache(store, engine, prefill_step=STEP), prompt, max_tokens=GEN_TOKENS)
    assert rep["source"] == "none"
    return out, engine.logits[-len(out):]


def test_two_models_that_differ_only_in_weights_share_a_directory(tok, model, prose, tmp_path):
    other = mlx_model.make_model(**OTHER)
    assert MLXEngine(model, tok).fingerprint != MLXEngine(other, tok).fingerprint
    prompt = text_of_tokens(tok, prose[2000:], 300)
    want = {"a": cold_output(model, tok, prompt, tmp_path, "a"), "b": cold_output(other, tok, prompt, tmp_path, "b")}
    assert not same(want["a"][1][0], want["b"][1][0])      # the two models answer differently
    d = tmp_path / "shared"
    sources = []
    # A stores; B comes next on the same directory and gets nothing of A's;
    # then each comes back and gets its own.
    for name, m in (("a", model), ("b", other), ("a", model), ("b", other)):
        engine = RecordingEngine(m, tok)
        with model_store(d, m, settings=SMALL) as store:
            out, rep = engine.generate(PromptCache(store, engine, prefill_step=STEP), prompt, max_tokens=GEN_TOKENS)
        assert out == want[name][0], name
        assert same_steps(engine.logits[-len(out):], want[name][1]), name
        sources.append(rep["source"])
    assert sources == ["none", "none", "disk", "disk"]
    with kvstore.KVStore(d, settings=SMALL) as s:
        tags = {e.model_tag for e in s.entries()}
    assert tags == {MLXEngine(model, tok).identity.tag, MLXEngine(other, tok).identity.tag}


def test_prompt_cache_and_load_prompt_cache_refuse_another_models_store(tok, model, tmp_path):
    other = mlx_model.make_model(**OTHER)
    with model_store(tmp_path / "kv", other, settings=SMALL) as store:
        with pytest.raises(ValueError, match="holds the state of model"):
            PromptCache(store, MLXEngine(model, tok))
        with pytest.raises(ValueError, match="holds the state of model"):
            kvstore.mlx.load_prompt_cache(store, "anything", model)
        with pytest.raises(ValueError, match="holds the state of model"):
            kvstore.mlx.save_prompt_cache(store, "abc", [1, 2, 3], mlx_model.make_cache(model), model)
    with kvstore.KVStore(tmp_path / "anonymous", settings=SMALL) as store:      # the quick start, no identity
        with pytest.raises(ValueError, match="model_identity=engine.identity"):
            PromptCache(store, MLXEngine(model, tok))
        with pytest.raises(ValueError, match="holds the state of model"):
            kvstore.mlx.load_prompt_cache(store, "anything", model)


def test_a_forged_state_becomes_a_cold_start_for_prompt_cache(tok, model, prose, tmp_path):
    # Another model's state saved under this model's name, tag and manifest
    # (valid CRCs): the canary fails, the request runs cold, and its output
    # is the model's own cold output.
    other = mlx_model.make_model(**OTHER)
    prompt = text_of_tokens(tok, prose[7000:], 300)
    ids = tok.encode(prompt)
    want, want_logits = cold_output(model, tok, prompt, tmp_path, "a")
    forged = mlx_model.make_cache(other)
    mlx_model.prefill(other, forged, ids[:256], step=STEP)
    d = tmp_path / "kv"
    with model_store(d, model, settings=SMALL) as store:
        assert save_prompt_cache(store, tok.token_bytes(ids[:256]), ids[:256], forged, model) is not None
    engine = RecordingEngine(model, tok)
    with model_store(d, model, settings=SMALL) as store:
        out, rep = engine.generate(PromptCache(store, engine, prefill_step=STEP), prompt, max_tokens=GEN_TOKENS)
        assert rep["source"] == "none" and rep["canary"] == "failed" and rep["reused_tokens"] == 0
        assert out == want and same_steps(engine.logits[-len(out):], want_logits)
        c = store.counters()
        assert c["canary_checks"] == 1 and c["canary_failures"] == 1
        assert os.listdir(d / ".quarantine")
    # The honest state the cold run stored passes and is used.
    engine = RecordingEngine(model, tok)
    with model_store(d, model, settings=SMALL) as store:
        out, rep = engine.generate(PromptCache(store, engine, prefill_step=STEP), prompt, max_tokens=GEN_TOKENS)
        assert rep["source"] == "disk" and rep["canary"] == "tail" and out == want
        assert same_steps(engine.logits[-len(out):], want_logits)
