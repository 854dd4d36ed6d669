"""`kvstore demo`, the main job, run as a user runs it: the console entry in a
subprocess, outside the source tree, on a fresh cache directory."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import kvstore  # noqa: E402


def test_demo_runs_the_agent_workload_across_a_restart(tmp_path):
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--dir", str(cache)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "Traceback" not in run.stderr
    rows = re.findall(r"^(ana|ben|chloe)\s+(\d)\s+(none|disk|memory)\s+(\d+)\s+(\d+)\s+(\d+)", out, re.M)
    assert len(rows) == 9                              # 3 users x 3 turns
    first = rows[0]
    assert first[:3] == ("ana", "1", "none") and int(first[3]) == 0
    # Every later request reuses the shared system prompt (or more).
    assert all(src != "none" and int(reused) >= 1000 for _, _, src, reused, _, _ in rows[1:])
    # The restart happened between the turns 2 and 3, and a new process served turn 3.
    restart = out.index("-- restart")
    assert all(out.index(f"{u:<6}    3") > restart for u in ("ana", "ben", "chloe"))
    assert re.search(r"chloe\s+switch to session [0-9a-f]{8} \(\d+ tokens", out)
    # The speed-up is reported; how large it is depends on the backend and the
    # machine (bench/ measures it), so only its presence is checked here.
    assert re.search(r"median TTFT: cold (\d+) ms, hit (\d+) ms, speed-up ([\d.]+)x", out)
    assert re.search(r"cache hits: 8 \(89%", out)
    # Every disk hit was checked against the model, and none failed.
    m = re.search(r"canary: (\d+) restored states checked against the model, (\d+) failed", out)
    disk = sum(src == "disk" for _, _, src, _, _, _ in rows)
    assert m and int(m.group(1)) >= disk >= 1 and m.group(2) == "0"
    # The checkpoints are on disk, valid, private, and hold the reasons the policy stores.
    entries = [kvstore.format.read_entry(cache / n) for n in os.listdir(cache) if n.endswith(".kv")]
    reasons = {e.reason.name.lower() for e in entries}
    assert {"cold", "evict", "shutdown", "agent_session"} <= reasons
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    assert all(os.stat(e.path).st_mode & 0o777 == 0o600 for e in entries)


def test_demo_rejects_a_missing_model_directory(tmp_path):
    run = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--model", str(tmp_path / "nope")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "nope" in run.stderr
