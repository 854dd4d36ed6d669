"""The package's rooms: imports run one way, no cycles, no private names across modules.

Data flows prompt -> index -> store -> prompt cache -> engine -> writer ->
directory (-> remote tier), and imports follow the same direction: a lower
room never imports a higher one, not even inside a function.  These tests
parse every module of the package (imports inside functions included) and
fail on any cycle, any upward import, and any private name (``_x``) taken
from another module.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvstore"

# Rooms from the bottom up.  A module may import its own room and the ones
# below; the package root (kvstore/__init__.py, public names only) sits
# between the libraries and the applications built on them.
LAYERS = [
    # The C core, the exceptions, thread pools that survive a fork, and the
    # calls that differ between platforms.
    ["kvstore._native", "kvstore.errors", "kvstore.executors", "kvstore.host"],
    # The file's parts, then what is built on them, up to the store: the
    # envelope and names; a file's bytes; which temporaries are debris; the
    # counters; the background writer.
    ["kvstore.format", "kvstore.names", "kvstore.sources", "kvstore.temps", "kvstore.counters", "kvstore.writer"],
    # Model identities, tenants' tags, the index snapshot, the journal, the
    # lookup forest, the payload, a store's settings, the pure rules, the
    # trailers (kvstore's and ds4's).
    ["kvstore.identity", "kvstore.tenants", "kvstore.index_snapshot", "kvstore.journal", "kvstore.forest",
     "kvstore.payload", "kvstore.settings", "kvstore.policy", "kvstore.ds4", "kvstore.trailers"],
    # The lookup index.
    ["kvstore.index"],
    # Writing and checking files; chains of blocks.
    ["kvstore.files", "kvstore.chain"],
    # Publishing a new file (temporary name, sync, put in place).
    ["kvstore.publish"],
    # What is written with them: small JSON sidecars, the model registry, the pins.
    ["kvstore.sidecars", "kvstore.registry", "kvstore.pins"],
    # The store's parts: the open directory and the codec (how a file's
    # bytes are read and written) below the reader, the saver and the
    # evictor; KVStore wires them.
    ["kvstore.codec", "kvstore.directory", "kvstore.tiers"],
    ["kvstore.reader", "kvstore.saver", "kvstore.evictor", "kvstore.divergence"],
    ["kvstore.store"],
    # Above the store: sealing (a codec it registers), the remote tier (an
    # opener it registers), the MLX adapter, the prompt cache, sessions.
    ["kvstore.seal", "kvstore.remote", "kvstore.mlx", "kvstore.prompt_cache", "kvstore.sessions", "kvstore.exchange"],
    ["kvstore"],
    ["kvstore.serve", "kvstore.demo"],
    ["kvstore.cli", "kvstore.__main__"],
]


def module_names():
    """Every module of the package: dotted name -> path."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    for path in PACKAGE.glob("*.pyx"):
        out["kvstore." + path.stem] = path
    return out


MODULES = module_names()


def room(name):
    """The layer index of a module: its longest listed prefix."""
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for r in layer:
            if (name == r or name.startswith(r + ".")) and len(r) > best_len:
                best, best_len = i, len(r)
    return best


def resolve(importer, node):
    """(module imported, [names imported from it]) for every kvstore import in an AST node."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name == "kvstore" or a.name.startswith("kvstore."):
                out.append((a.name, []))
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = importer.split(".")
            if not MODULES.get(importer, pathlib.Path()).name == "__init__.py":
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if mod == "kvstore" or mod.startswith("kvstore."):
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:
                    out.append((sub, []))        # a submodule, imported by name
                else:
                    out.append((mod, [a.name]))
    return out


def imports():
    """importer -> [(imported module, names, line)], for every import statement anywhere."""
    graph = {}
    for name, path in MODULES.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = []
        for node in ast.walk(tree):
            for mod, names in resolve(name, node):
                edges.append((mod, names, node.lineno))
        graph[name] = edges
    return graph


GRAPH = imports()


def test_every_module_has_a_room():
    missing = [m for m in MODULES if room(m) is None]
    assert not missing, f"modules outside every room of LAYERS: {missing}"


def test_no_upward_import():
    bad = []
    for importer, edges in GRAPH.items():
        for mod, _, line in edges:
            if mod == importer or mod.startswith(importer + "."):
                continue                       # a package's own submodules
            if room(mod) > room(importer):
                bad.append(f"{MODULES[importer].relative_to(PACKAGE.parent)}:{line} imports {mod} "
                           f"(room {room(mod)} above {room(importer)})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycle():
    # Module-level graph (a package's __init__ counts as a module; a package
    # importing its own submodules is not a cycle through itself).
    edges = {m: sorted({mod for mod, _, _ in e if mod in MODULES and mod != m}) for m, e in GRAPH.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in edges.get(m, ()):
            if n.startswith(m + "."):
                continue
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in edges:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_across_modules():
    bad = []
    for importer, edges in GRAPH.items():
        for mod, names, line in edges:
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{MODULES[importer].relative_to(PACKAGE.parent)}:{line} imports {mod}.{n}")
    # mod._name attribute use on an imported kvstore module.
    for importer, path in MODULES.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for mod, names in resolve(importer, node):
                    if not names:
                        for a in node.names:
                            aliases[a.asname or a.name.split(".")[-1]] = mod
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != importer
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses "
                           f"{aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("importer,target,expect", [
    ("kvstore.store", "kvstore.remote.tier", "upward"),
    ("kvstore.format", "kvstore.names", "same room"),
    ("kvstore.format", "kvstore.policy", "upward"),
    ("kvstore.seal", "kvstore.files", "downward"),
    ("kvstore.seal", "kvstore.store", "downward"),
    ("kvstore.saver", "kvstore.seal", "upward"),
    ("kvstore.cli.local", "kvstore.store", "downward"),
])
def test_rooms_rank_as_documented(importer, target, expect):
    # The check itself: a store importing the remote tier would be upward.
    a, b = room(importer), room(target)
    assert {"upward": b > a, "same room": a == b, "downward": b < a}[expect]


# The rooms' table, the one list of the package's rooms in their order.
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def layout_rows():
    """Module or package name -> its row in docs/ARCHITECTURE.md's layout table (lowest first)."""
    text = ARCHITECTURE.read_text()
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    table = text[start:end if end != -1 else len(text)]
    rows, i = {}, 0
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        for path in cell.split("`")[1::2]:
            path = path if "/" in path or not path.endswith((".py", ".pyx")) else "kvstore/" + path
            if path.startswith("kvstore/"):
                name = path.rstrip("/").removesuffix(".py").removesuffix(".pyx").replace("/", ".")
                rows[name] = i
        i += 1
    return rows


ROWS = layout_rows()


def layout_row(name):
    best = max((r for r in ROWS if name == r or name.startswith(r + ".")), key=len, default=None)
    return None if best is None else ROWS[best]


def test_every_module_is_in_the_layout_table():
    missing = [m for m in MODULES if m not in ("kvstore", "kvstore.__main__") and layout_row(m) is None]
    assert not missing, f"modules docs/ARCHITECTURE.md's layout table does not list: {missing}"


def test_imports_follow_the_layout_order():
    # Finer than LAYERS: inside a room too, a module imports only the rows
    # the layout table lists before its own (or its own row).
    bad = []
    for importer, edges in GRAPH.items():
        a = layout_row(importer)
        for mod, _, line in edges:
            b = layout_row(mod)
            if a is not None and b is not None and b > a:
                bad.append(f"{MODULES[importer].relative_to(PACKAGE.parent)}:{line} imports {mod}, "
                           f"which the layout table lists after it")
    assert not bad, "imports against the layout table's order:\n" + "\n".join(bad)


def test_layout_order_agrees_with_layers():
    order = sorted(ROWS, key=ROWS.get)
    rooms = [room(m) for m in order]
    assert rooms == sorted(rooms), [(m, room(m)) for m in order]


def test_the_layout_table_lives_in_one_place():
    """The rooms' table is docs/ARCHITECTURE.md's alone: a second copy would drift."""
    root = PACKAGE.parent
    holders = [p.relative_to(root).as_posix() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
               if "| room | its one job |" in p.read_text()]
    assert holders == ["docs/ARCHITECTURE.md"], holders
