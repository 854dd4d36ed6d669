"""The read jobs of a chain load (kvstore.payload.chains): its pieces cut
into jobs of about equal size and handed to the I/O threads as they come,
packed and quantised blocks in jobs of their own (one native call each),
then every piece's CRC joined and checked (docs/format.md §14, §20).
"""

from kvstore import _native
from kvstore.payload.buffers import pread_into, thread_scratch
from kvstore.payload.pool import IO_THREADS, JOB_BYTES, MIN_SLICE, check_crc, io_pool
from kvstore.sources import as_source, sealed

# Packed pieces go to the I/O threads in jobs of about this many stored
# bytes: a block's tensor is a piece, and a job each would cost more in the
# pool than unpacking a small one.
PACKED_JOB = 4 << 20


class Batch:
    """The reads of a chain load, handed to the I/O threads as they come.

    Each add() cuts its pieces (by runs) into parts of at most an even share
    of their bytes and deals the parts, in file order, into at most
    IO_THREADS jobs of about equal size: each job reads its parts in one
    native call with the GIL released.  wait() joins the parts' CRCs per
    piece (in file order) and checks them, first piece first.
    """

    def __init__(self, buffers, verify):
        """Args:
            buffers: writable byte views the pieces land in.
            verify: check every piece's CRC32C.
        """
        self.buffers = buffers
        self.verify = verify
        self.pieces = []            # Piece, in the order added
        self.jobs = []              # (future, [(piece index, bytes)])
        self.pace = None            # called with a job's stream position before it reads

    def add(self, pieces, last=False, pos=0):
        """Queues [(buffer index, Piece)].  last: no more will come; a first
        and last add that fits one job runs at once, on the calling thread.
        pos: where the pieces begin in the stream of self.pace (each job
        calls pace with its own place before it reads).  Packed pieces go
        in jobs of their own (_add_packed)."""
        if any(p.packed is not None for _, p in pieces):
            pos = self._add_packed([(b, p) for b, p in pieces if p.packed is not None], pos)
            pieces = [(b, p) for b, p in pieces if p.packed is None]
            if not pieces:
                return
        first = len(self.pieces)
        self.pieces.extend(p for _, p in pieces)
        total = sum(p.run * p.count for _, p in pieces)
        jobs = max(1, min(IO_THREADS, total // MIN_SLICE))
        src = pieces[0][1].fd if pieces else 0
        if sealed(src) and jobs > 1:
            # A sealed chain's blocks are kvstore.seal.SealedSource objects,
            # which decrypt and authenticate the chunks they read: the work
            # is planned once, chunk by chunk, and each job takes an equal
            # run of whole chunks (no per-piece results: the tags vouch).
            work = src.chunk_work(self.buffers, [(b, p.fd, p.file_offset, p.run, p.count, p.stride, p.dst)
                                                 for b, p in pieces])
            pool = io_pool()
            for j in range(jobs):
                share = work[len(work) * j // jobs:len(work) * (j + 1) // jobs]
                self.jobs.append((pool.submit(src.read_chunks, self.buffers, share), []))
            return
        # A large block is cut in jobs of at most JOB_BYTES, so that the
        # read-ahead window follows its reads (Prefetcher).
        jobs = max(jobs, -(-total // JOB_BYTES))
        share = max(1, -(-total // jobs))
        if jobs == 1:
            # One job (a small load): every piece whole, as it came.
            groups = [[(i, p.run * p.count, (b, p.fd, p.file_offset, p.run, p.count, p.stride, p.dst))
                       for i, (b, p) in enumerate(pieces, first)]]
        else:
            groups = _deal(pieces, first, jobs, share)
        groups = [g for g in groups if g]
        read = as_source(src).read_pieces
        if last and not self.jobs and len(groups) == 1:
            g = groups[0]
            self.jobs.append((_Done(self._read, pos, read, [part[2] for part in g]), [part[:2] for part in g]))
            return
        pool = io_pool()
        for g in groups:
            self.jobs.append((pool.submit(self._read, pos, read, [part[2] for part in g]), [part[:2] for part in g]))
            pos += sum(part[1] for part in g)

    def _add_packed(self, pieces, pos):
        """Queues packed pieces in jobs of about PACKED_JOB stored bytes, in
        order (a job per piece would cost more than unpacking a small one);
        returns the stream position after them."""
        pool, group, size = io_pool(), [], 0
        for k, (b, p) in enumerate(pieces):
            self.pieces.append(p)
            group.append((len(self.pieces) - 1, b, p))
            size += p.packed[0]
            if size >= PACKED_JOB or k == len(pieces) - 1:
                self.jobs.append((pool.submit(self._unpack, pos, [(b, p) for _, b, p in group]),
                                  [(i, p.packed[0]) for i, _, p in group]))
                pos += size
                group, size = [], 0
        return pos

    def _unpack(self, pos, pieces):
        """A job of packed pieces: each one's stored bytes read and checked,
        then unpacked into its runs; [(status, CRC32C of its stored bytes)].
        Table-plane and quantised blocks of plain files go in one native
        call (_native.read_packed); the others (sealed files, quantised
        runs that are not whole groups) one by one."""
        if self.pace is not None:
            self.pace(pos)
        forms = [p.packed[1].native_for(p.run) for _, p in pieces]
        if all(f is not None and not sealed(p.fd) for f, (_, p) in zip(forms, pieces)):
            return _native.read_packed(self.buffers, [
                (b, p.fd, p.file_offset, p.packed[0], f, p.dst, p.run, p.count, p.stride, p.crc)
                for f, (b, p) in zip(forms, pieces)], self.verify)
        out = []
        for b, p in pieces:
            stored, form = p.packed
            buf = thread_scratch("packed", stored)
            crc = pread_into(p.fd, buf, p.file_offset, p.path, crc=0)
            if not self.verify or crc == p.crc:
                form.unpack(buf, self.buffers[b], (p.dst, p.run, p.count, p.stride), p.path, p.what)
            out.append((0, crc))
        return out

    def _read(self, pos, read, parts):
        """A job: moves the read-ahead window to pos, then reads parts."""
        if self.pace is not None:
            self.pace(pos)
        return read(self.buffers, parts, self.verify)

    def wait(self):
        """Waits for every read; raises for the first piece that failed
        (CorruptCheckpoint for a short file or a CRC mismatch, OSError)."""
        status = [0] * len(self.pieces)
        crcs = [None] * len(self.pieces)
        error = None
        for fut, parts in self.jobs:
            try:
                results = fut.result()
            except Exception as e:      # every job joined, even after a failure
                error = error or e
                continue
            for (i, n), (rc, crc) in zip(parts, results):
                if rc:
                    status[i] = status[i] or rc
                elif crcs[i] is None:
                    crcs[i] = crc
                else:
                    crcs[i] = _native.crc32c_combine(crcs[i], crc, n)
        self.jobs = []
        if error is not None:
            raise error
        for p, rc, crc in zip(self.pieces, status, crcs):
            if rc:
                _native.raise_status(rc, p.path, p.what)
            if self.verify:
                if (crc or 0) != p.crc:
                    check_crc(crc or 0, p.crc, p.path, p.what)


def _deal(pieces, first, jobs, share):
    """Batch.add's jobs: [(piece index, bytes, the native read's part)] per
    job, pieces cut by runs into parts of at most share bytes, in file order."""
    groups, size = [[]], 0
    for i, (b, p) in enumerate(pieces, first):
        step = max(1, p.count if p.nbytes <= share else share // p.run)
        for run0 in range(0, p.count, step):
            k = min(step, p.count - run0)
            if size and size + k * p.run > share and len(groups) < jobs:
                groups.append([])
                size = 0
            groups[-1].append((i, k * p.run, (b, p.fd, p.file_offset + run0 * p.run, p.run, k, p.stride,
                                              p.dst + run0 * p.stride)))
            size += k * p.run
    return groups


class _Done:
    """A job run at once, in the caller's thread (a load too small to share out)."""

    def __init__(self, fn, *args):
        try:
            self.value, self.error = fn(*args), None
        except Exception as e:
            self.value, self.error = None, e

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value
