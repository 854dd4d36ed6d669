"""What a newcomer meets first: the command line answers --help whatever
extras are installed."""

import subprocess
import sys

# A Python that cannot import MLX or mlx-lm (as where `kvstore[serve]` is
# not installed): each import of them fails as a missing module does.
WITHOUT_MLX = ("import sys\n"
               "for m in ('mlx', 'mlx.core', 'mlx_lm', 'mlx_lm.server'):\n"
               "    sys.modules[m] = None\n"
               "from kvstore.cli import main\n"
               "sys.exit(main(sys.argv[1:]))\n")


def run_without_mlx(*args):
    return subprocess.run([sys.executable, "-c", WITHOUT_MLX, *args], capture_output=True, text=True, timeout=60)


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


def test_every_section_a_test_or_module_cites_exists():
    """A "docs/format.md §N" in the tests or the package names a section
    that docs/format.md has (the tests once cited a SPEC file that is not
    in the repository)."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    have = set(re.findall(r"^## §(\d+) ", (root / "docs" / "format.md").read_text(), re.M))
    cited = {}
    for path in list((root / "tests").glob("*.py")) + list((root / "kvstore").rglob("*.py")):
        text = path.read_text()
        if re.search(r"\bSPEC (section|\d)", text) and path.name != "test_surface.py":
            cited.setdefault("SPEC", []).append(path.name)
        for m in re.finditer(r"docs/format\.md(?:'s)? §(\d+)((?:(?:, | and |-)§(\d+))*)", text):
            for n in re.findall(r"\d+", m.group(0).split("§", 1)[1]):
                cited.setdefault(n, []).append(path.name)
    assert "SPEC" not in cited, cited.get("SPEC")
    missing = {n: sorted(set(p)) for n, p in cited.items() if n not in have}
    assert not missing, missing
    assert len(cited) >= 15                     # the citations were found
