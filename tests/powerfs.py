"""A power-loss filesystem for tests, over FUSE (mfusepy on libfuse 3).

Every call passes through to a backing directory, and the filesystem keeps
what a real disk would still owe after it:

- a file's data written since its last fsync (or fdatasync): the bytes it
  had at that sync are what survives, the pages written since are pending;
- a directory's names created, renamed, linked or removed since its last
  fsync: the names it had at that sync survive, the changes since are
  pending.

A power cut (cut(), or arm(k): after the k-th write, truncate, create,
link, rename, unlink, mkdir, rmdir or sync) freezes the mount: from then on
every call fails with EIO, as a dead machine answers nothing.  survive()
then writes what a reboot would find into a fresh directory:

- mode "synced": the synced state only, the strictest reading of POSIX (a
  file whose name is durable but whose data never was is empty);
- mode "reorder": the synced state plus a random subset of the pending page
  writes (4 KiB pages, each with the last bytes written to it, the file's
  size either the synced one or the current one) and of each directory's
  pending name changes (applied in their order, a rename whole or not at
  all): the reorderings a drive's cache may make, as LazyFS and the ALICE
  study model them;
- mode "barrier", on a mount reset with barriers=True (macOS's
  F_BARRIERFSYNC and F_FULLFSYNC): there an fdatasync is a barrier that
  orders, an fsync a full flush, and what survives is the flushed state plus
  a prefix of the barriers' snapshots (tests/powerfs_ledger.py).

The filesystem runs in its own process (``python powerfs.py BACKING MOUNT``),
its FUSE loop on the main thread; the test drives it through PowerFS, a
client that speaks JSON lines on the process's stdin and stdout.  Running
the mount in the test's own process would let a FUSE call wait for the GIL
that a thread blocked on the mount holds.

A file removed (unlinked, or replaced by a rename) while a durable name may
still point at it is kept in a graveyard beside the backing tree, so that
its bytes are there to survive.
"""

import contextlib
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time

from powerfs_ledger import Ledger, hidden


# The calls a power cut can come after (arm's k counts them).
MUTATING = ("create", "write", "truncate", "fallocate", "link", "rename", "unlink", "mkdir", "rmdir",
            "fsync", "fsyncdir")


def fuse_unavailable():
    """Why a FUSE mount cannot be made here (a sentence), or None."""
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy cannot be imported ({type(e).__name__}: {e}); pip install mfusepy"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        return "fusermount3 is missing (Debian: apt-get install fuse3) and this is not root"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    return None


def unmount(mountpoint):
    """Lazily unmounts a FUSE mount (fusermount3, or umount as root); quiet when it is not mounted."""
    cmd = ["fusermount3", "-u", "-z", mountpoint] if shutil.which("fusermount3") else ["umount", "-l", mountpoint]
    subprocess.run(cmd, check=False, capture_output=True)


# ---- the filesystem (in its own process) ------------------------------------------

def _filesystem(root):
    """The mfusepy Operations over root/backing-N, with the control calls."""
    import mfusepy

    class PowerLossFS(mfusepy.Operations):
        use_ns = True
        # Calls on an open file or directory come with its handle and no
        # path: a file unlinked while open (a published temporary) is still
        # there for fstat, as on any disk.
        flag_nopath = True
        flag_nullpath_ok = True

        def __init__(self):
            self.mutex = threading.RLock()
            self.generation = 0
            self.fds = {}                     # fh -> (fd, id)
            self.dirs = {}                    # fh -> the open directory's relative path
            self.next_fh = 0
            self.reset()

        # -- control ------------------------------------------------------------------

        def reset(self, seed_from=None, barriers=False):
            with self.mutex:
                for fd, _ in self.fds.values():
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self.fds.clear()
                self.generation += 1
                backing = os.path.join(root, f"backing-{self.generation}")
                graveyard = os.path.join(root, f"graveyard-{self.generation}")
                old = getattr(self, "model", None)
                if seed_from:
                    shutil.copytree(seed_from, backing, symlinks=True)
                else:
                    os.makedirs(backing)
                os.makedirs(graveyard)
                self.model = Ledger(backing, graveyard, bool(barriers))
                if old is not None:
                    shutil.rmtree(old.backing, ignore_errors=True)
                    shutil.rmtree(old.graveyard, ignore_errors=True)
                return {"backing": backing}

        def control(self, req):
            cmd = req["cmd"]
            with self.mutex:
                m = self.model
                if cmd == "reset":
                    return self.reset(req.get("seed_from"), req.get("barriers", False))
                if cmd == "arm":
                    m.arm_at = m.ops + req["after"]
                    return {}
                if cmd == "cut":
                    m.frozen = True
                    return {}
                if cmd == "state":
                    return {"ops": m.ops, "frozen": m.frozen, "trace": m.trace[-60:], "barriers": m.barrier_calls}
                if cmd == "survive":
                    m.frozen = True
                    return m.survive(req["dest"], req["mode"], random.Random(req["seed"]))
            raise ValueError(f"unknown command {cmd!r}")

        # -- helpers ------------------------------------------------------------------

        def _rel(self, path):
            return "?" if path is None else path.lstrip("/")

        def _live(self):
            if self.model.frozen:
                raise mfusepy.FuseOSError(errno.EIO)
            return self.model

        def _mutate(self, what, path, fh=None):
            m = self._live()
            if path is None and fh in self.fds:           # name the open file by where its bytes are
                path = "/" + os.path.relpath(m.where.get(self.fds[fh][1], "?"), m.backing)
            elif path is None and fh in self.dirs:
                path = "/" + self.dirs[fh]
            m.count(what, self._rel(path))
            return m

        # -- reading ------------------------------------------------------------------

        def getattr(self, path, fh=None):
            with self.mutex:
                m = self._live()
                try:
                    # An open file by its handle: it may have no name left (fstat after unlink).
                    st = os.fstat(self.fds[fh][0]) if fh in self.fds else os.lstat(m.path(self._rel(path)))
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
            out = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino")}
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)   # use_ns
            return out

        def readdir(self, path, fh):
            with self.mutex:
                m = self._live()
                rel = self.dirs[fh] if path is None else self._rel(path)
                return [".", ".."] + [n for n in os.listdir(m.path(rel)) if not hidden(n)]

        def access(self, path, amode):
            with self.mutex:
                if not os.access(self._live().path(self._rel(path)), amode):
                    raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path):
            with self.mutex:
                sv = os.statvfs(self._live().backing)
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                  "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def open(self, path, flags):
            with self.mutex:
                m = self._live()
                rel = self._rel(path)
                try:
                    fd = os.open(m.path(rel), flags & ~(os.O_CREAT | os.O_EXCL))
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
                if flags & os.O_TRUNC:
                    m.count("truncate", rel)
                    m.resized(m.ids[rel], len(m.data.get(m.ids[rel], b"")), 0)
                return self._handle(fd, m.ids[rel])

        def _handle(self, fd, i):
            self.next_fh += 1
            self.fds[self.next_fh] = (fd, i)
            return self.next_fh

        def read(self, path, size, offset, fh):
            with self.mutex:
                self._live()
                fd, _ = self.fds[fh]
                return os.pread(fd, size, offset)

        def release(self, path, fh):
            with self.mutex:
                entry = self.fds.pop(fh, None)
                if entry is not None:
                    os.close(entry[0])
            return 0

        def flush(self, path, fh):
            # close() flushes: nothing to write through (writes go straight
            # to the backing file), and a close never fails, cut or not.
            return 0

        # -- writing ------------------------------------------------------------------

        def create(self, path, mode, fi=None):
            with self.mutex:
                m = self._mutate("create", path)
                rel = self._rel(path)
                try:
                    fd = os.open(m.path(rel), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
                return self._handle(fd, m.created(rel, "file"))

        def write(self, path, data, offset, fh):
            with self.mutex:
                m = self._mutate("write", path, fh)
                fd, i = self.fds[fh]
                n = os.pwrite(fd, data, offset)
                m.written(i, offset, n)
                return n

        def truncate(self, path, length, fh=None):
            with self.mutex:
                m = self._mutate("truncate", path, fh)
                if fh in self.fds:
                    fd, i = self.fds[fh]
                    old = os.fstat(fd).st_size
                    os.ftruncate(fd, length)
                else:
                    rel = self._rel(path)
                    i = m.ids[rel]
                    old = os.stat(m.path(rel)).st_size
                    os.truncate(m.path(rel), length)
                m.resized(i, old, length)
            return 0

        def fallocate(self, path, mode, offset, length, fh):
            with self.mutex:
                m = self._mutate("fallocate", path, fh)
                if mode != 0:
                    raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
                fd, i = self.fds[fh]
                old = os.fstat(fd).st_size
                os.posix_fallocate(fd, offset, length)
                m.resized(i, old, max(old, offset + length))
            return 0

        def fsync(self, path, datasync, fh):
            with self.mutex:
                m = self._mutate("fsync", path, fh)
                fd, i = self.fds[fh]
                m.synced_file(i, fd, bool(datasync))
            return 0

        def fsyncdir(self, path, datasync, fh):
            with self.mutex:
                m = self._mutate("fsyncdir", path, fh)
                m.synced_dir(self.dirs[fh] if path is None else self._rel(path), bool(datasync))
            return 0

        def opendir(self, path):
            with self.mutex:
                self._live()
                self.next_fh += 1
                self.dirs[self.next_fh] = self._rel(path)
                return self.next_fh

        def releasedir(self, path, fh):
            with self.mutex:
                self.dirs.pop(fh, None)
            return 0

        def mkdir(self, path, mode):
            with self.mutex:
                m = self._mutate("mkdir", path)
                rel = self._rel(path)
                try:
                    os.mkdir(m.path(rel), mode)
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
                m.created(rel, "dir")
            return 0

        def rmdir(self, path):
            return self._remove("rmdir", path)

        def unlink(self, path):
            return self._remove("unlink", path)

        def _remove(self, what, path):
            with self.mutex:
                m = self._mutate(what, path)
                try:
                    m.unlink(self._rel(path))
                except KeyError:
                    raise mfusepy.FuseOSError(errno.ENOENT) from None
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
            return 0

        def rename(self, old, new, flags=0):
            with self.mutex:
                m = self._mutate("rename", old)
                o, n = self._rel(old), self._rel(new)
                if o not in m.ids:
                    raise mfusepy.FuseOSError(errno.ENOENT)
                if flags:
                    raise mfusepy.FuseOSError(errno.EINVAL)
                if n in m.ids and m.kind[m.ids[n]] == "dir":
                    raise mfusepy.FuseOSError(errno.EISDIR)
                try:
                    if hidden(os.path.basename(n)):
                        m.hide(o, n)
                    else:
                        m.rename(o, n)
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
            return 0

        def link(self, target, source):
            # mfusepy passes (the new name, the existing file).
            with self.mutex:
                m = self._mutate("link", target)
                t, s = self._rel(target), self._rel(source)
                if s not in m.ids:
                    raise mfusepy.FuseOSError(errno.ENOENT)
                try:
                    os.link(m.path(s), m.path(t))
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno) from None
                m.linked(s, t)
            return 0

        def chmod(self, path, mode):
            with self.mutex:
                if path is not None:           # an open file's (fchmod...): its mode is the create's
                    os.chmod(self._live().path(self._rel(path)), mode)
            return 0

        def chown(self, path, uid, gid):
            with self.mutex:
                if path is not None:           # an open file's (fchmod...): its mode is the create's
                    os.chown(self._live().path(self._rel(path)), uid, gid)
            return 0

        def utimens(self, path, times=None):
            with self.mutex:
                if path is not None:           # an open file's (fchmod...): its mode is the create's
                    os.utime(self._live().path(self._rel(path)), ns=times)
            return 0

    return PowerLossFS()


def _serve(root, mountpoint):
    """The process's main: the FUSE loop here, the control lines on a thread."""
    import mfusepy
    fs = _filesystem(root)

    def control():
        out = sys.stdout
        if not os.path.ismount(mountpoint):
            print(json.dumps({"ready": False}), file=out, flush=True)
            return
        print(json.dumps({"ready": True}), file=out, flush=True)
        for line in sys.stdin:
            try:
                reply = {"ok": True, **fs.control(json.loads(line))}
            except Exception as e:            # noqa: BLE001 - reported to the client
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), file=out, flush=True)
        unmount(mountpoint)

    def start_control():
        # After the mount is up: wait until the mount point is the mount.
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint) and time.monotonic() < deadline:
            time.sleep(0.01)
        control()

    threading.Thread(target=start_control, daemon=True).start()
    class FUSE(mfusepy.FUSE):
        def truncate_fuse_3(self, path, length, fip):
            # mfusepy drops the handle of an ftruncate; with flag_nopath the path is None.
            fh = fip.contents.fh if fip else None
            return self.operations.truncate(None if path is None else path.decode(self.encoding, self.errors),
                                            length, fh)

    FUSE(fs, mountpoint, foreground=True, nothreads=False, attr_timeout=0, entry_timeout=0, negative_timeout=0)


# ---- the client (in the test's process) ----------------------------------------------

class MountFailed(RuntimeError):
    """The FUSE mount could not be made (the tests skip, saying why)."""


@contextlib.contextmanager
def mounted(root):
    """A PowerFS at root for a test module; skips the tests, with the reason, where it cannot mount."""
    import pytest
    try:
        fs = PowerFS(root)
    except MountFailed as e:
        pytest.skip(str(e))
    with fs:
        yield fs


class PowerFS:
    """A power-loss mount at ``mount``, backed under ``root`` (a fresh directory).

    Use as a context manager; ``reset()`` starts a new backing tree, ``arm(k)``
    cuts the power after k more mutating calls, ``survive(dest, mode, seed)``
    writes what survives.
    """

    def __init__(self, root):
        self.root = os.fspath(root)
        self.mount = os.path.join(self.root, "mnt")
        os.makedirs(self.mount, exist_ok=True)
        os.makedirs(os.path.join(self.root, "fs"), exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), os.path.join(self.root, "fs"),
                                      self.mount], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(os.path.join(self.root, "fs.log"), "wb"), text=True)
        ready = self.proc.stdout.readline()
        if not ready or not json.loads(ready).get("ready"):
            self.close()
            with open(os.path.join(self.root, "fs.log")) as f:
                raise MountFailed(f"the power-loss filesystem did not mount at {self.mount}: {f.read()[-2000:]}")

    def _call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if not reply.pop("ok"):
            raise RuntimeError(reply["error"])
        return reply

    def reset(self, seed_from=None, barriers=False):
        """A new backing tree (a copy of seed_from, all of it durable; else
        empty).  barriers: an fdatasync is a barrier, an fsync a full flush
        (powerfs_ledger's docstring: macOS's F_BARRIERFSYNC and F_FULLFSYNC)."""
        return self._call(cmd="reset", seed_from=seed_from and os.fspath(seed_from), barriers=bool(barriers))

    def arm(self, after):
        self._call(cmd="arm", after=int(after))

    def cut(self):
        self._call(cmd="cut")

    def state(self):
        """{"ops": mutating calls since the reset, "frozen": bool, "trace": the last calls,
        "barriers": the barriers made (a mount reset with barriers)}."""
        return self._call(cmd="state")

    def survive(self, dest, mode, seed):
        """Cuts the power (if not yet) and writes what survives into dest."""
        return self._call(cmd="survive", dest=os.fspath(dest), mode=mode, seed=int(seed))

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        unmount(self.mount)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
