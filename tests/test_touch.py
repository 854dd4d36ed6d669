"""kvstore.format.touch: the atomic in-place hit update, with real processes for the
concurrency and kill tests."""

import os
import random
import signal
import struct
import time

import pytest

import kvstore
from kvhelpers import CTX

TEXT = b"a prompt prefix"
PAYLOAD = b"\x01\x02payload\xfe\xff" * 10
TRAILER = b"trailer!"


def expected_after(blob, hits, now):
    """blob with only the hit count (offset 12, u32) and last_used (32, u64) changed."""
    b = bytearray(blob)
    b[12:16] = struct.pack("<I", hits)
    b[32:40] = struct.pack("<Q", now)
    return bytes(b)


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def kv(checkpoint_file):
    return checkpoint_file(TEXT, PAYLOAD, TRAILER, hits=0, last_used=1000, created_at=500)


def test_touch_increments_and_returns_new_count(kv):
    before = read(kv)
    for i in range(1, 6):
        assert kvstore.format.touch(kv, now=2000 + i) == i
        e = kvstore.format.read_entry(kv)
        assert (e.hits, e.last_used, e.created_at) == (i, 2000 + i, 500)
    assert read(kv) == expected_after(before, 5, 2005)


def test_touch_from_nonzero_count(checkpoint_file):
    path = checkpoint_file(hits=41)
    assert kvstore.format.touch(path, now=7) == 42
    assert kvstore.format.read_entry(path).hits == 42


def test_touch_default_now_is_current_time(kv):
    t0 = int(time.time())
    assert kvstore.format.touch(kv) == 1
    t1 = int(time.time())
    assert t0 <= kvstore.format.read_entry(kv).last_used <= t1


def test_touch_changes_no_other_byte(checkpoint_file, envelope):
    # Junk in the reserved bytes and unknown flag bits must survive too.
    header = bytearray(kvstore.format.Header(quant_bits=16, tokens=3, ctx_size=9, payload_bytes=len(PAYLOAD),
                                      hits=5, reason=kvstore.format.Reason.AGENT_SYSTEM, model_id=200,
                                      payload_abi=16, created_at=2**63, last_used=1).pack())
    header[6] = 0xF3
    header[21:24] = b"\xde\xad\xbe"
    path = checkpoint_file(TEXT, PAYLOAD, TRAILER, header=bytes(header))
    before = read(path)
    st0 = os.stat(path)
    assert kvstore.format.touch(path, now=0x0102030405060708) == 6
    after = read(path)
    assert after == expected_after(before, 6, 0x0102030405060708)
    assert os.stat(path).st_size == st0.st_size and os.stat(path).st_ino == st0.st_ino


def test_touch_saturates(checkpoint_file):
    path = checkpoint_file(hits=2**32 - 2)
    assert kvstore.format.touch(path, now=10) == 2**32 - 1
    assert kvstore.format.touch(path, now=11) == 2**32 - 1
    assert kvstore.format.touch(path, now=12) == 2**32 - 1
    e = kvstore.format.read_entry(path)
    assert (e.hits, e.last_used) == (2**32 - 1, 12)


@pytest.mark.parametrize("now", [0, 1, 2**32, 2**64 - 1])
def test_touch_now_extremes(kv, now):
    kvstore.format.touch(kv, now=now)
    assert kvstore.format.read_entry(kv).last_used == now


@pytest.mark.parametrize("now", [-1, 2**64])
def test_touch_now_out_of_range(kv, now):
    before = read(kv)
    with pytest.raises(ValueError, match=str(now)):
        kvstore.format.touch(kv, now=now)
    assert read(kv) == before


def test_touch_refuses_symlink(kv, tmp_path):
    link = tmp_path / ("1" * 40 + ".kv")
    os.symlink(kv, link)
    before = read(kv)
    with pytest.raises(kvstore.errors.UnsafePath) as ei:
        kvstore.format.touch(link, now=5)
    assert os.fspath(link) in str(ei.value) and "symlink" in str(ei.value)
    assert read(kv) == before


@pytest.mark.parametrize("content,reason", [
    (b"", "truncated"),
    (b"KVC\x01", "truncated"),
    (b"KVC\x01\x04" + bytes(46), "truncated"),          # 51 bytes: header but no text length
    (b"not a checkpoint at all, just some text\n" * 3, "bad_magic"),
    (b"\x00" * 4096, "bad_magic"),
])
def test_touch_refuses_non_checkpoint(tmp_path, content, reason):
    path = tmp_path / ("2" * 40 + ".kv")
    path.write_bytes(content)
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.touch(path, now=5)
    assert ei.value.reason == reason
    assert os.fspath(path) in str(ei.value) and reason in str(ei.value)
    assert path.read_bytes() == content


@pytest.mark.parametrize("offset,value,reason", [(3, b"\x02", "bad_version"), (8, bytes(4), "zero_tokens"),
                                                 (0, b"KVD", "bad_magic")])
def test_touch_refuses_bad_header(kv, offset, value, reason):
    blob = bytearray(read(kv))
    blob[offset:offset + len(value)] = value
    with open(kv, "wb") as f:
        f.write(blob)
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.touch(kv, now=5)
    assert ei.value.reason == reason
    assert read(kv) == bytes(blob)


def test_touch_missing(tmp_path):
    path = tmp_path / ("3" * 40 + ".kv")
    with pytest.raises(kvstore.errors.CheckpointMissing) as ei:
        kvstore.format.touch(path, now=5)
    assert isinstance(ei.value, FileNotFoundError)
    assert os.fspath(path) in str(ei.value)
    assert not path.exists()


def test_touch_refuses_directory_and_fifo(tmp_path):
    d = tmp_path / ("4" * 40 + ".kv")
    d.mkdir()
    with pytest.raises(kvstore.errors.UnsafePath):
        kvstore.format.touch(d, now=5)
    fifo = tmp_path / ("5" * 40 + ".kv")
    os.mkfifo(fifo)
    with pytest.raises(kvstore.errors.UnsafePath) as ei:
        kvstore.format.touch(fifo, now=5)
    assert os.fspath(fifo) in str(ei.value)


# ---- real processes -------------------------------------------------------

N_PROCS, N_TOUCHES = 4, 2000


def _touch_n(path, n, start, results):
    start.wait(10)
    got = [kvstore.format.touch(path, now=1_000_000 + i) for i in range(n)]
    results.put(got)


def test_touch_concurrent_processes_lose_nothing(kv):
    before = read(kv)
    start, results = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_touch_n, args=(kv, N_TOUCHES, start, results)) for _ in range(N_PROCS)]
    for p in procs:
        p.start()
    start.set()
    deadline = time.monotonic() + 30
    returned = [results.get(timeout=max(0.1, deadline - time.monotonic())) for _ in procs]
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        assert p.exitcode == 0
    total = N_PROCS * N_TOUCHES
    e = kvstore.format.read_entry(kv)
    assert e.hits == total
    # An atomic add hands every caller a distinct count: 1..total exactly once.
    assert sorted(h for got in returned for h in got) == list(range(1, total + 1))
    for got in returned:
        assert got == sorted(got)
    assert 1_000_000 <= e.last_used < 1_000_000 + N_TOUCHES
    assert read(kv) == expected_after(before, total, e.last_used)


def _touch_forever(path, counter, base_now):
    n = 0
    while True:
        kvstore.format.touch(path, now=base_now + n + 1)
        n += 1
        counter.value = n            # after each touch: n touches are complete


def test_touch_survives_sigkill_at_random_moments(kv):
    rng = random.Random(1234)
    before = read(kv)
    hits = 0
    base_now = 10**9
    for round_ in range(20):
        counter = CTX.RawValue("q", 0)
        base_now += 10**6
        p = CTX.Process(target=_touch_forever, args=(kv, counter, base_now))
        p.start()
        deadline = time.monotonic() + 10
        warmup = rng.randrange(1, 50)
        while counter.value < warmup:
            assert time.monotonic() < deadline, "child never touched the file"
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 0.005))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        done = counter.value
        e = kvstore.format.read_entry(kv)             # the header still parses
        # The kill may land after a touch and before the counter update.
        assert done <= e.hits - hits <= done + 1, (round_, done, e.hits - hits)
        # last_used is the now of the last or the interrupted touch (the
        # count is added before last_used is stored).
        assert e.last_used in (base_now + done, base_now + done + 1)
        hits = e.hits
        assert read(kv) == expected_after(before, hits, e.last_used)
