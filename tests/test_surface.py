"""What a newcomer meets first: the command line answers --help whatever
extras are installed; the README fits in 12 KiB; the docs' links lead to
files and their section citations to sections that exist."""

import pathlib
import re
import subprocess
import sys
import tempfile

# A Python that cannot import MLX or mlx-lm (as where `kvstore[serve]` is
# not installed): each import of them fails as a missing module does.
WITHOUT_MLX = ("import sys\n"
               "for m in ('mlx', 'mlx.core', 'mlx_lm', 'mlx_lm.server'):\n"
               "    sys.modules[m] = None\n"
               "from kvstore.cli import main\n"
               "sys.exit(main(sys.argv[1:]))\n")


def run_without_mlx(*args):
    # cwd away from the source tree: `python -c` puts the cwd first on
    # sys.path, and the repository's un-built kvstore/ must not shadow the
    # installed one.
    return subprocess.run([sys.executable, "-c", WITHOUT_MLX, *args], capture_output=True, text=True, timeout=60,
                          cwd=tempfile.gettempdir())


def test_serve_help_works_without_mlx_lm():
    r = run_without_mlx("serve", "--help")
    assert r.returncode == 0, r.stderr
    for option in ("--model", "--cache-dir", "--budget-mb", "--kv-codec", "--cache-key-file", "--warm"):
        assert option in r.stdout
    assert "mlx_lm.server options: not available here" in r.stdout
    assert "pip install 'kvstore[serve]'" in r.stdout


def test_serve_without_mlx_lm_says_what_to_install():
    r = run_without_mlx("serve", "--model", "somewhere")
    assert r.returncode == 2
    assert "kvstore serve:" in r.stderr and "pip install 'kvstore[serve]'" in r.stderr


def test_the_other_commands_need_no_mlx():
    r = run_without_mlx("--help")
    assert r.returncode == 0, r.stderr
    assert "serve" in r.stdout and "ls" in r.stdout


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))

# A citation: a doc's path, then one section or a list of them ("§4",
# "§7 and §14", "§4-§9, §11"); a line break (and a comment's "#" or "*") may
# come between the path and the first section.  The code cites
# "docs/<file>.md §N"; a doc cites a sibling as "<file>.md §N".
CITATION = re.compile(r"(?<![\w/.-])(?P<path>(?:docs/)?[\w-]+\.md)(?:'s)?(?:[ \t]*\n[ \t]*(?:#|\*|//)?)?[ \t]*"
                      r"§(?P<sections>\d+(?:(?:, | and |-|–)§\d+)*)")
BARE = re.compile(r"(?<![\w.§])§(\d+)")


def sections_of(path):
    """The numbers of a doc's "## §N " headings; empty for a file that is not there."""
    return set(re.findall(r"^## §(\d+) ", path.read_text(), re.M)) if path.is_file() else set()


def section_numbers(text):
    """"4-§9, §11" -> ["4", ..., "9", "11"]: a range cites every section in it."""
    out = []
    for part in re.split(r", | and ", text):
        ends = [int(n) for n in re.findall(r"\d+", part)]
        out += [str(n) for n in range(ends[0], ends[-1] + 1)]
    return out


def citations(path, text):
    """[(the doc cited, section number)] of every citation in text, and text with them blanked.

    In docs/ a doc's sibling may go without "docs/"; elsewhere a citation
    names docs/ (a path is the repository's)."""
    found = []
    for m in CITATION.finditer(text):
        cited = m.group("path")
        if cited.startswith("docs/"):
            doc = ROOT / cited
        elif path.parent == ROOT / "docs":
            doc = path.parent / cited
        else:
            continue                             # not a doc's citation (bench/README.md has no sections)
        found += [(doc, n) for n in section_numbers(m.group("sections"))]
    return found, CITATION.sub(lambda m: " " * len(m.group(0)), text)


def test_every_section_a_test_or_module_cites_exists():
    """A "docs/<file>.md §N" in the tests, the package, the benchmarks or the
    C core names a section that docs/<file>.md has: sections kept their
    numbers when docs/format.md was split by reader, and a citation follows
    its section to the file that holds it now (the tests once cited a SPEC
    file that is not in the repository)."""
    sources = [*(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "csrc").glob("*.[ch]"),
               *(p for ext in ("py", "pyx", "pxd", "pxi") for p in (ROOT / "kvstore").rglob(f"*.{ext}")),
               ROOT / "pyproject.toml"]
    cited, missing = {}, {}
    for path in sources:
        text = path.read_text()
        if re.search(r"\bSPEC (section|\d)", text) and path.name != "test_surface.py":
            cited.setdefault("SPEC", []).append(path.name)
        for doc, n in citations(path, text)[0]:
            cited.setdefault((doc.name, n), []).append(path.name)
            if n not in sections_of(doc):
                missing.setdefault(f"{doc.relative_to(ROOT)} §{n}", set()).add(path.name)
    assert "SPEC" not in cited, cited.get("SPEC")
    assert not missing, {k: sorted(v) for k, v in missing.items()}
    assert len(cited) >= 15                     # the citations were found
    assert {doc for doc, _ in cited} >= {"format.md", "semantics.md", "remote.md"}


def test_every_section_a_doc_cites_exists():
    """README.md and docs/*.md cite sections that exist too: "docs/<file>.md
    §N" (or, between docs, "<file>.md §N"), and a bare "§N" inside a doc is
    one of that doc's own sections."""
    missing = []
    for path in [ROOT / "README.md", ROOT / "bench" / "README.md", *DOCS]:
        found, rest = citations(path, path.read_text())
        missing += [f"{path.relative_to(ROOT)}: {doc.name} §{n}" for doc, n in found if n not in sections_of(doc)]
        if path.parent == ROOT / "docs":
            own = sections_of(path)
            for line in rest.splitlines():
                if not line.startswith("#"):
                    missing += [f"{path.relative_to(ROOT)}: §{n} (bare)" for n in BARE.findall(line) if n not in own]
    assert not missing, missing


def test_the_readme_is_at_most_12_kib():
    """The README is the newcomer's page: what kvstore is, install, three quick starts, links."""
    size = (ROOT / "README.md").stat().st_size
    assert size <= 12_288, f"README.md is {size:,} bytes; move the detail to docs/"


def test_every_relative_link_in_the_docs_points_at_a_file():
    """Each relative link of README.md and docs/*.md ([text](path) or an image)
    names a file or directory that exists, relative to the page."""
    link = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
    bad, seen = [], 0
    for path in [ROOT / "README.md", *DOCS]:
        text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())      # code blocks hold no links
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in link.findall(text):
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
                continue                         # a URL or an anchor on the same page
            seen += 1
            if not (path.parent / target.split("#")[0]).exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}")
    assert not bad, bad
    assert seen >= 10                            # the links were found


def public_names(module):
    """The names a module offers: __all__, and every public non-module
    attribute (none may hide outside __all__)."""
    import types
    loose = {n for n in dir(module) if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)}
    assert loose == set(module.__all__), loose ^ set(module.__all__)
    return module.__all__


def test_the_top_level_is_small():
    import kvstore
    names = public_names(kvstore)
    assert len(names) <= 12, names
    assert {"KVStore", "Settings", "Match", "Checkpoint", "PromptCache", "KVStoreError"} <= set(names)
    # The format's helpers live in kvstore.format, every error in kvstore.errors.
    import kvstore.errors
    import kvstore.format
    for n in ("Header", "Entry", "Reason", "ExtFlag", "read_entry", "touch", "sha1", "sha1_prefixes", "crc32c"):
        assert callable(getattr(kvstore.format, n)) and not hasattr(kvstore, n), n
    assert all(issubclass(getattr(kvstore.errors, n), kvstore.KVStoreError)
               for n in ("CheckpointMissing", "UnsafePath", "AmbiguousSession"))


def test_the_mlx_adapter_is_small():
    import pytest
    pytest.importorskip("mlx_lm")
    import kvstore.mlx
    names = public_names(kvstore.mlx)
    assert len(names) <= 8, names
    assert {"save_prompt_cache", "load_prompt_cache", "MLXEngine", "model_fingerprint"} <= set(names)


def test_a_models_quant_bits_and_context_are_read_in_one_place():
    """kvstore.mlx.spec reads config.json (kvstore serve, before the model
    loads) and a loaded model's args (MLXEngine) alike."""
    import types
    import pytest
    pytest.importorskip("mlx_lm")
    from kvstore.mlx import spec
    for q in ({"quantization": {"bits": 4, "group_size": 64}}, {"quantization_config": {"bits": 8}}):
        assert spec.quant_bits(q) == q.get("quantization", q.get("quantization_config"))["bits"]
        assert spec.quant_bits(types.SimpleNamespace(**q)) == spec.quant_bits(q)
    assert spec.quant_bits({}) == 16 and spec.quant_bits({"quantization": {"bits": 7}}) == 16
    assert spec.ctx_size({"max_position_embeddings": 4096}) == 4096
    assert spec.ctx_size(types.SimpleNamespace()) == spec.DEFAULT_CTX_SIZE


def test_a_model_spec_is_built_once_and_the_engine_uses_it():
    """ModelSpec: the identity, quant bits, context and KV kinds of a model,
    the same whether the engine or a server (with its config.json) builds it."""
    import types
    import pytest
    pytest.importorskip("mlx_lm")
    import mlx.nn as nn
    from kvstore.demo import model as demo_model
    from kvstore.mlx import MLXEngine, model_fingerprint
    from kvstore.mlx.spec import ModelSpec
    model = demo_model.make_model(seed=1, layers=2, hidden=64, heads=2, kv_heads=1)
    spec = ModelSpec.of(model)
    assert spec.identity.fingerprint == model_fingerprint(model)
    assert spec.quant_bits == 16 and spec.kv_kinds == ("KVCache", "KVCache")
    assert spec.ctx_size == (model.args.max_position_embeddings or 32768)
    assert spec.store_settings() == {"quant_bits": 16, "ctx_size": spec.ctx_size}
    tokenizer = types.SimpleNamespace(encode=lambda s: list(s.encode()), decode=lambda ids: bytes(ids).decode())
    engine = MLXEngine(model, tokenizer)
    assert engine.spec == spec and (engine.quant_bits, engine.ctx_size) == (16, spec.ctx_size)
    # A server's config.json is read first; a draft model joins the identity.
    config = {"max_position_embeddings": 4096, "quantization": {"bits": 8, "group_size": 64}}
    assert ModelSpec.of(model, config=config).store_settings() == {"quant_bits": 8, "ctx_size": 4096}
    other = demo_model.make_model(seed=2, layers=2, hidden=64, heads=2, kv_heads=1)
    assert ModelSpec.of(model, draft=other).identity.fingerprint != spec.identity.fingerprint
    assert ModelSpec.of(model, max_kv_size=64).identity.fingerprint != spec.identity.fingerprint
    # A quantised model says its bits where no config does.
    nn.quantize(model, group_size=32, bits=4)
    assert ModelSpec.of(model).quant_bits == 4


def test_the_public_api_type_checks():
    """mypy over the public modules (mypy.ini lists them): the hints the API
    carries hold (.ci/run installs mypy; where it is missing this skips)."""
    import importlib.util
    import os
    import pytest
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy; .ci/run installs it)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(root, "mypy.ini")],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout
