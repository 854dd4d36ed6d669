"""The GitHub Actions workflow (.github/workflows/ci.yml): it runs README.md's
two commands on Linux and on macOS (Apple Silicon), and it is a valid
workflow by GitHub's schema (check-jsonschema's copy, which .ci/run
installs).  It cannot run here: these checks are all this repository can
do for it."""

import os
import re
import shutil
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOW = os.path.join(ROOT, ".github", "workflows", "ci.yml")


def readme_commands():
    """README.md's two commands: the set-up with the demo, and the tests."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"## Set up, run the demo, test\n.*?```sh\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def workflow():
    with open(WORKFLOW) as f:
        return yaml.safe_load(f)


def test_the_workflow_runs_the_readmes_two_commands_on_linux_and_macos():
    setup, tests = readme_commands()
    job = workflow()["jobs"]["test"]
    assert set(job["strategy"]["matrix"]["os"]) == {"ubuntu-latest", "macos-14"}   # macos-14: Apple Silicon
    assert all(v >= "3.11" for v in job["strategy"]["matrix"]["python"])         # mlx-lm's floor
    runs = [step.get("run", "") for step in job["steps"]]
    assert setup in runs
    # The tests run in the environment the first command made.
    assert any(run.endswith(tests) and ".venv/bin/activate" in run for run in runs)
    assert runs.index(setup) < next(i for i, run in enumerate(runs) if run.endswith(" " + tests))


def _check_jsonschema():
    exe = shutil.which("check-jsonschema") or os.path.join(os.path.dirname(sys.executable), "check-jsonschema")
    if not os.path.exists(exe):
        pytest.skip("check-jsonschema is not installed (.ci/run installs it)")
    return exe


def test_the_workflow_is_valid_by_githubs_schema(tmp_path):
    exe = _check_jsonschema()
    ok = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", WORKFLOW],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The check can fail: a job without runs-on is refused.
    with open(WORKFLOW) as f:
        text = f.read()
    bad = tmp_path / "ci.yml"
    bad.write_text(re.sub(r"\n\s*runs-on:[^\n]*", "", text))
    assert "runs-on" not in bad.read_text()
    refused = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", str(bad)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
