"""mlx-lm's internals are touched in one module, and an unsupported mlx-lm fails there.

kvstore.mlx.mlxlm is the only module of the package that names a private
attribute or method of mlx-lm, or subclasses an mlx-lm class; the rest of
the package uses its public functions and hooks.  These tests parse every
module of the package to hold that, check that no kvstore subclass shadows
a name mlx-lm's own classes use (a new mlx-lm release adding it would
otherwise be overridden without a sound), and that an mlx-lm release outside
SUPPORTED_MLX_LM fails the import of kvstore.mlx and kvstore.serve with a
message naming it, while `import kvstore` needs no mlx-lm at all.
"""

import ast
import inspect
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvstore"
INTERNALS = PACKAGE / "mlx" / "mlxlm.py"

# Rooms whose modules hold mlx-lm objects (caches, tokenizers, the server's
# provider, generator and handler) even where they import no mlx-lm name.
MLX_LM_ROOMS = ("mlx", "serve")

ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _root(node):
    """The Name an expression like a.b.c, a.b(), a[0].c starts from, or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _bindings(tree):
    """(names bound to mlx-lm, names bound to kvstore.mlx.mlxlm, names bound to other imports)."""
    mlx_lm, internals, other = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]
                if a.name == "mlx_lm" or a.name.startswith("mlx_lm."):
                    mlx_lm.add(bound)
                elif a.name == "kvstore.mlx.mlxlm" and a.asname:
                    internals.add(bound)
                else:
                    other.add(bound)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                bound = a.asname or a.name
                if node.module == "mlx_lm" or node.module.startswith("mlx_lm."):
                    mlx_lm.add(bound)
                elif node.module == "kvstore.mlx.mlxlm" or (node.module == "kvstore.mlx" and a.name == "mlxlm"):
                    internals.add(bound)
                else:
                    other.add(bound)
    return mlx_lm, internals, other - mlx_lm - internals


def _faces_mlx_lm(path, tree, mlx_lm, internals):
    rel = path.relative_to(PACKAGE)
    if rel.parts[0] in MLX_LM_ROOMS:
        return True
    return bool(mlx_lm or internals) or any(
        isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("kvstore.mlx") for n in ast.walk(tree))


def _own_names(cls, local):
    """Names a class (and the module's own classes it derives from) defines or assigns on self."""
    names = set()
    todo, seen = [cls], set()
    while todo:
        c = todo.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        for node in ast.walk(c):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) == "self":
                names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
        todo += [local[_root(b)] for b in c.bases if _root(b) in local]
    return names


def _derived_classes(tree, roots):
    """The module's classes that derive from a name in roots, through its own classes too."""
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    local = {c.name: c for c in classes}
    derived, grew = {}, True
    while grew:
        grew = False
        for c in classes:
            if c.name not in derived and any(_root(b) in roots or _root(b) in derived for b in c.bases):
                derived[c.name] = c
                grew = True
    return derived, local


def _self_reads(cls):
    """(line, name) of every private name a class reads off self (getattr(self, "_x") included)."""
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and _private(node.attr)):
            yield node.lineno, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            yield node.lineno, node.args[1].value


def _direct_uses(tree, mlx_lm):
    """Subclasses of mlx-lm classes, private names of mlx-lm modules and objects imported by name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for b in node.bases:
                if _root(b) in mlx_lm:
                    yield node.lineno, f"class {node.name} subclasses mlx-lm's {ast.unparse(b)}"
        elif isinstance(node, ast.Attribute) and _private(node.attr) and _root(node.value) in mlx_lm:
            yield node.lineno, f"names mlx-lm's {ast.unparse(node)}"
        elif (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mlx_lm"
              and any(_private(a.name) for a in node.names)):
            yield node.lineno, f"imports a private name from {node.module}"


def _object_uses(tree, other):
    """Private attributes named on any object but self, cls and non-mlx-lm modules; super()._x."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            v = node.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                yield node.lineno, f"calls super().{node.attr}"
            elif not (isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in other)):
                yield node.lineno, f"names {ast.unparse(node)}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            yield node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"


def mlx_lm_internals_used(path, source=None):
    """Every place a module names a private attribute of an mlx-lm object or subclasses an mlx-lm class.

    Args:
        path: the module's path in the package.
        source: its text (None: read from path).

    Returns:
        list of "path:line what".
    """
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    mlx_lm, internals, other = _bindings(tree)
    found = list(_direct_uses(tree, mlx_lm))
    if _faces_mlx_lm(path, tree, mlx_lm, internals):
        found += _object_uses(tree, other)
        derived, local = _derived_classes(tree, mlx_lm | internals)
        for cls in derived.values():
            own = _own_names(cls, local)
            found += [(line, f"class {cls.name} reads self.{name}, which it inherits from mlx-lm")
                      for line, name in _self_reads(cls) if name not in own]
    rel = path.relative_to(PACKAGE.parent)
    return sorted({f"{rel}:{line} {what}" for line, what in found})


def test_only_the_internals_module_touches_mlx_lm_internals():
    assert INTERNALS.is_file()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != INTERNALS:
            bad += mlx_lm_internals_used(path)
    assert not bad, "mlx-lm internals outside kvstore/mlx/mlxlm.py:\n" + "\n".join(bad)


def test_the_check_finds_what_the_internals_module_does():
    # The check is not vacuous: run on the one module, it sees its accesses.
    found = "\n".join(mlx_lm_internals_used(INTERNALS))
    for what in ("_idx", "_model_map", "super()._tokenize", "super()._set_stream_headers",
                 "subclasses mlx-lm's mlx_server.ResponseGenerator", "subclasses mlx-lm's LRUPromptCache"):
        assert what in found, (what, found)


@pytest.mark.parametrize("source, what", [
    ("from mlx_lm import server\nclass G(server.ResponseGenerator):\n    pass\n", "subclasses"),
    ("from mlx_lm.models import cache as c\nx = c.RotatingKVCache._idx\n", "names mlx-lm's"),
    ("def key(provider):\n    return provider._model_map\n", "provider._model_map"),
    ("from kvstore.mlx.mlxlm import HookedAPIHandler\nclass H(HookedAPIHandler):\n"
     "    def f(self):\n        self._set_completion_headers(200)\n", "reads self._set_completion_headers"),
    ("class H(object):\n    def f(self):\n        super()._set_stream_headers(200)\n", "super()._set_stream_headers"),
    ("def hf(t):\n    return getattr(t, '_tokenizer', t)\n", "'_tokenizer'"),
])
def test_the_check_catches_each_kind_of_access(source, what):
    found = "\n".join(mlx_lm_internals_used(PACKAGE / "serve" / "example.py", source))
    assert what in found, found


# ---- no kvstore class shadows a name mlx-lm's classes use -------------------------

def _mlx_lm_names(cls):
    """Every name mlx-lm's classes in cls's MRO define, or set or read on self."""
    names = set()
    for k in cls.__mro__:
        if k.__module__.split(".")[0] != "mlx_lm":
            continue
        names |= set(vars(k))
        tree = ast.parse(textwrap.dedent(inspect.getsource(k)))
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _root(n) == "self"}
    return names


def _source_names(cls):
    """Names a kvstore class defines or assigns on self in its own source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return set(vars(cls)) | {n.attr for n in ast.walk(tree)
                             if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _root(n) == "self"}


def test_no_kvstore_class_shadows_an_mlx_lm_name():
    pytest.importorskip("mlx_lm")
    from kvstore.mlx import mlxlm
    from kvstore.serve import generator, http, tier
    # The hooks the internals module adds must stay names mlx-lm does not use.
    overrides = {"push", "remove", "pop",        # _ReportingOrder: mlx-lm's LRU order, on purpose
                 # HookedAPIHandler: every response mlx-lm builds passes with_usage, on purpose.
                 "generate_response", "completion_usage_response"}
    bad = []
    for cls in (mlxlm.HookedResponseGenerator, mlxlm.HookedAPIHandler, mlxlm.ReportingPromptCache):
        hooks = {n for n in vars(cls) if not n.startswith("_")} - overrides
        bad += [f"{cls.__name__}.{n}" for n in sorted(hooks & _mlx_lm_names(cls))]
    # Every other class keeps its private names off mlx-lm's.
    handler = http.handler_class(False, None, None)
    for cls in (generator.TieredResponseGenerator, tier.TieredPromptCache, handler, *handler.__mro__[1:]):
        if cls.__module__.startswith("kvstore.serve"):
            own = {n for n in _source_names(cls) if _private(n)}
            bad += [f"{cls.__module__}.{cls.__name__}.{n}" for n in sorted(own & _mlx_lm_names(cls))]
    assert not bad, "names mlx-lm's classes use already:\n" + "\n".join(bad)


# ---- the supported releases --------------------------------------------------------

def test_an_unsupported_mlx_lm_is_refused_with_both_versions(monkeypatch):
    mlx_lm = pytest.importorskip("mlx_lm")
    from kvstore.mlx import mlxlm
    lo, hi = mlxlm.SUPPORTED_MLX_LM
    mlxlm.check_version()                                   # the installed release passes
    for version in (f"{hi[0]}.{hi[1]}.0", f"{lo[0]}.{lo[1] - 1}.9", "1.0.0"):
        monkeypatch.setattr(mlx_lm, "__version__", version)
        with pytest.raises(ImportError) as e:
            mlxlm.check_version()
        message = str(e.value)
        assert f"installed: mlx-lm {version}" in message
        assert f">= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}" in message
    monkeypatch.setattr(mlx_lm, "__version__", f"{lo[0]}.{lo[1]}.7")
    mlxlm.check_version()


IMPORTS = r"""
import json, sys
import mlx_lm
mlx_lm.__version__ = sys.argv[1]
out = {}
for name in ("kvstore.mlx", "kvstore.serve.server"):
    try:
        __import__(name)
        out[name] = None
    except ImportError as e:
        out[name] = str(e)
print(json.dumps(out))
"""

WITHOUT_MLX_LM = r"""
import sys
sys.modules["mlx_lm"] = None          # import mlx_lm now fails
import kvstore
print(kvstore.KVStore.__name__, "mlx_lm" in sys.modules and sys.modules["mlx_lm"] is not None)
"""


def test_importing_kvstore_mlx_or_serve_with_an_unsupported_mlx_lm_raises(tmp_path):
    pytest.importorskip("mlx_lm")
    p = subprocess.run([sys.executable, "-c", IMPORTS, "0.99.1"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # (kvstore.serve itself imports its parts lazily, so that `kvstore serve
    # --help` answers without mlx-lm: its server is what needs mlx-lm.)
    for name in ("kvstore.mlx", "kvstore.serve.server"):
        assert out[name] is not None and "installed: mlx-lm 0.99.1" in out[name] and "0.32" in out[name], out


def test_import_kvstore_needs_no_mlx_lm(tmp_path):
    p = subprocess.run([sys.executable, "-c", WITHOUT_MLX_LM], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["KVStore", "False"]


# ---- the RAM reuse a request would get -------------------------------------------------------

def _prompt_cache(trimmable):
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache
    if trimmable:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 4, 2)), mx.zeros((1, 1, 4, 2)))
    else:
        c = ArraysCache(1)
        c[0] = mx.zeros((1, 2))
    return [c]


@pytest.mark.parametrize("seed", range(12))
def test_ram_reuse_bounds_hold_what_the_fetch_reuses(seed):
    # The tier's lookup walks the trie once (ram_reuse_bounds) instead of
    # mlx-lm's full search: the bounds must hold the reuse that
    # fetch_nearest_cache gives, and be it when they agree.
    import random

    from kvstore.mlx import mlxlm
    rng = random.Random(seed)
    cache = mlxlm.ReportingPromptCache(max_size=1000)
    stored = []
    for _ in range(rng.randint(1, 12)):
        base = rng.choice(stored) if stored and rng.random() < 0.6 else []
        tokens = base[:rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(1, 12))]
        cache.insert_cache("m", tokens, _prompt_cache(rng.random() < 0.7))
        stored.append(tokens)
    for _ in range(40):
        base = rng.choice(stored)
        prompt = base[:rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
        if not prompt:
            continue
        lo, hi = cache.ram_reuse_bounds("m", prompt)
        reuse = cache.ram_reuse("m", prompt)
        _, rest = cache.fetch_nearest_cache("m", prompt)
        assert reuse == len(prompt) - len(rest)
        assert lo <= reuse <= hi, (prompt, lo, reuse, hi)
        if lo == hi:
            assert reuse == lo
    assert cache.ram_reuse_bounds("other", [1, 2]) == (0, 0)


def test_ram_reuse_bounds_at_the_edges():
    from kvstore.mlx import mlxlm
    cache = mlxlm.ReportingPromptCache(max_size=100)
    cache.insert_cache("m", [7], _prompt_cache(True))                 # one token: reused as a "longer" entry,
    cache.insert_cache("m", [3], _prompt_cache(False))                # when it can be trimmed
    cache.insert_cache("m", [1, 2, 3, 4], _prompt_cache(False))       # longer, cannot be trimmed
    cache.insert_cache("m", [5, 6, 7, 8], _prompt_cache(True))        # longer, can be trimmed
    for prompt, want in (([7, 9], 1), ([3, 9], 0), ([1, 2, 3, 4], 4), ([1, 2, 9], 0), ([5, 6, 9], 2), ([5, 6], 1),
                         ([9], 0)):
        lo, hi = cache.ram_reuse_bounds("m", prompt)
        assert cache.ram_reuse("m", prompt) == want and lo <= want <= hi, (prompt, lo, hi)


# ---- a sequence's KV out of a batch: views, not copies ------------------------------

def test_extract_views_hands_out_views_of_the_batch_with_the_same_values(monkeypatch):
    """kvstore serve's batches hand a finished sequence's KV out as views of
    the batch's buffers (nothing to copy on the generation thread before a
    store can read it), holding what mlx-lm's own extract holds."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from kvstore.mlx import mlxlm
    stock = BatchKVCache.extract
    monkeypatch.setattr(BatchKVCache, "extract", stock)       # restored after the test
    caches = []
    for n in (5, 9):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))
        caches.append(c)
    batch = BatchKVCache.merge(caches)
    mx.eval(batch.keys, batch.values)
    want = [stock(batch, i) for i in range(2)]
    mlxlm.extract_views()
    assert BatchKVCache.extract is not stock
    mlxlm.extract_views()                                      # idempotent
    for i, n in enumerate((5, 9)):
        got = batch.extract(i)
        assert got.offset == want[i].offset == n
        for a, b, buf in ((got.keys, want[i].keys, batch.keys), (got.values, want[i].values, batch.values)):
            assert np.array_equal(np.array(a), np.array(b))
            mx.eval(a)
            assert np.shares_memory(np.asarray(a), np.asarray(buf))      # a view: no copy was made
        if i == 0:          # left-padded in the batch: a strided slice, which stock copies
            assert not np.shares_memory(np.asarray(want[i].keys), np.asarray(batch.keys))
