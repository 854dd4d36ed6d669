"""ds4's files in a kvstore directory: reference vectors written and read back by ds4's own code.

tests/ds4/vectors/ was made by tests/ds4/generate.py from the ds4 commit in
vectors/COMMIT; expected.txt holds what ds4's readers made of each file.
With KVSTORE_DS4_SOURCE naming a ds4 checkout (and a C compiler), the
vectors are made again and must come out byte for byte the same.
"""

import json
import logging
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvstore import KVStore, ds4, sessions, trailers
from kvstore.errors import SessionNotFound
from kvstore.format import ExtFlag, Reason, read_entry

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds4")
VECTORS = os.path.join(HERE, "vectors")


def _expected():
    with open(os.path.join(VECTORS, "expected.txt"), encoding="utf-8") as f:
        return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)


EXPECTED = _expected()


def _file(key):
    return os.path.join(VECTORS, EXPECTED[key + ".sha"] + ".kv")


def _parts(path):
    """(text, trailer) bytes of a checkpoint file, cut by its header."""
    with open(path, "rb") as f:
        data = f.read()
    payload_bytes, text_bytes = struct.unpack_from("<QI", data, 40)
    return data[52:52 + text_bytes], data[52 + text_bytes + payload_bytes:]


def test_the_vectors_name_their_ds4_commit():
    with open(os.path.join(VECTORS, "COMMIT")) as f:
        commit = f.read().strip()
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), commit


def test_a_ds4_header_reads_as_ds4_reads_it_and_abi_0_is_ds4s():
    e = read_entry(_file("server"))
    assert (e.quant_bits, int(e.reason), int(e.ext_flags), e.tokens) == tuple(
        int(EXPECTED[f"server.{k}"]) for k in ("quant_bits", "reason", "ext_flags", "tokens"))
    assert (e.text_bytes, e.payload_bytes) == (int(EXPECTED["server.text_bytes"]),
                                               int(EXPECTED["server.payload_bytes"]))
    assert e.payload_abi == 0 and ds4.is_ds4(e) and not e.loadable
    assert e.ext_flags & ExtFlag.TOOL_MAP and e.ext_flags & ExtFlag.THINKING_VISIBLE


def test_ds4s_tool_map_is_read_and_written_byte_for_byte(caplog):
    _, trailer = _parts(_file("server"))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        values, sections, flags = trailers.parse_trailer(trailer, "server.kv")
    assert not caplog.records                                   # nothing dropped, nothing misread
    assert (flags, sections) == (1, [])
    ids = EXPECTED["server.tool_ids"].split(",")
    assert sorted(values[0]) == sorted(ids) and len(values[0]) == int(EXPECTED["server.tool_map_loaded"])
    text, _ = _parts(_file("server"))
    for dsml in values[0].values():                             # the DSML block the text holds
        assert dsml.encode() in text
    assert ds4.encode_tool_map(values[0]) == trailer            # what ds4-server writes, in its order


def test_kvstore_and_ds4_trailers_are_never_taken_for_each_other(caplog):
    tool_map = {"toolu_1": "<call/>", "call_2": "x"}
    ours, flags = trailers.encode_trailer({0: tool_map, 3: "a title"})
    assert flags == 0b1001 and not ds4.is_tool_map(ours) and ours[0] <= trailers.MAX_BIT
    assert trailers.parse_trailer(ours)[0] == {0: tool_map, 3: "a title"}
    # A kvstore section whose body happens to be KTM bytes is a body, not ds4's map.
    framed, _ = trailers.encode_trailer({}, keep=[trailers.Section(5, ds4.encode_tool_map(tool_map))])
    values, sections, flags = trailers.parse_trailer(framed)
    assert (values, flags) == ({}, 1 << 5) and sections[0].body.startswith(ds4.KTM_MAGIC)
    with pytest.raises(ValueError, match="no KTM"):
        ds4.parse_tool_map(ours)
    # A cut KTM trailer is dropped with one line, never half-read.
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert trailers.parse_trailer(ds4.encode_tool_map(tool_map)[:-3]) == ({}, [], 0)
    assert "reason=ds4_tool_map" in caplog.text and "<call/>" not in caplog.text
    with pytest.raises(ValueError):
        ds4.encode_tool_map({"": "x"})


@pytest.mark.parametrize("key", ["session", "session2"])
def test_a_ds4_session_is_titled_as_ds4_agent_titles_it(key):
    text, _ = _parts(_file(key))
    assert ds4.session_title(text) == EXPECTED[f"{key}.title"]
    e = read_entry(_file(key))
    assert e.reason == Reason.AGENT_SESSION and e.sha == EXPECTED[f"{key}.sha"]
    assert ds4.session_title(b"no markers") == "(no user prompt)"
    assert ds4.session_title("<｜User｜>  \n <｜Assistant｜>".encode()) == "(empty user prompt)"


def test_a_directory_with_ds4_files_lists_them_and_never_loads_them(tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    for name in os.listdir(VECTORS):
        if name.endswith(".kv"):
            shutil.copy(os.path.join(VECTORS, name), d / name)
    with KVStore(str(d), budget_mb=0) as store:
        assert len(store.entries()) == 3
        text, _ = _parts(_file("server"))
        assert store.find(text + b" and more") is None          # ds4's graph state: never loaded
        listed = sessions.list(store)
        assert {s.sha for s in listed} == {EXPECTED["session.sha"], EXPECTED["session2.sha"]}
        assert all(s.ds4 and s.title is None for s in listed)
        with pytest.raises(SessionNotFound, match="ds4"):
            sessions.switch(store, EXPECTED["session.sha"][:8])
        # A kvstore save beside them still works and still loads.
        store.save(b"kvstore's own text " * 40, np.arange(600, dtype=np.uint32),
                   {"k": np.ones((1, 2, 600, 4), np.float16)}, positional={"k": 2})
        assert store.find(b"kvstore's own text " * 40 + b"!") is not None
    titled = sessions.from_entries(KVStore(str(d), budget_mb=0).entries(), text=True)
    assert {s.title for s in titled} == {EXPECTED["session.title"], EXPECTED["session2.title"]}


def test_the_command_line_shows_ds4_files_and_their_session_titles_only_when_asked(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvstore", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=60, cwd=tmp_path)
    ls = run("ls", VECTORS)
    assert ls.returncode == 0 and ls.stdout.count("0(ds4)") == 3 and "3 written by ds4" in ls.stdout
    inspect = run("inspect", _file("server"))
    assert "ds4 tool map (KTM v1), 2 entries" in inspect.stdout and "ds4's graph state" in inspect.stdout
    plain = run("session", "list", VECTORS)
    assert plain.stdout.count("(ds4)") == 2 and "Refactor" not in plain.stdout
    titled = run("session", "list", VECTORS, "--text", "--json")
    assert {s["title"] for s in json.loads(titled.stdout)} == {
        EXPECTED["session.title"], EXPECTED["session2.title"]}


@pytest.mark.skipif(not os.environ.get("KVSTORE_DS4_SOURCE") or shutil.which(os.environ.get("CC", "cc")) is None,
                    reason="KVSTORE_DS4_SOURCE (a ds4 checkout) and a C compiler regenerate the vectors")
def test_the_vectors_regenerate_byte_for_byte_from_ds4(tmp_path):
    copy = tmp_path / "ds4"
    shutil.copytree(HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, str(copy / "generate.py"), os.environ["KVSTORE_DS4_SOURCE"]],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for name in os.listdir(VECTORS):
        if name != "COMMIT":
            assert (copy / "vectors" / name).read_bytes() == open(os.path.join(VECTORS, name), "rb").read(), name
