"""A real S3 API server: s3proxy (org.gaul:s3proxy) with its filesystem backend, on 127.0.0.1.

Objects live as plain files under ``<data_dir>/s3/objects/<bucket>/<key>``; requests are authenticated
(AWS signature v2 or v4) with settings' access and secret key. After start the default bucket exists.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .errors import InfraError
from .process import JavaServer, render_properties
from .settings import Settings

_LOGBACK = """\
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>{log}</file>
    <encoder><pattern>%d{{HH:mm:ss.SSS}} %-5level %logger{{36}} - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""


def s3proxy_properties(settings: Settings, objects_dir: Path, bind: str = "127.0.0.1") -> dict[str, str]:
    """s3proxy's --properties file for our port (on ``bind``), credentials and object directory."""
    return {
        "s3proxy.endpoint": f"http://{bind}:{settings.s3_port}",
        "s3proxy.authorization": "aws-v2-or-v4",
        "s3proxy.identity": settings.s3_access_key,
        "s3proxy.credential": settings.s3_secret_key,
        "jclouds.provider": "filesystem",
        "jclouds.filesystem.basedir": str(objects_dir),
    }


@dataclass
class S3Server(JavaServer):
    """The project's S3 server for one ``Settings`` (its s3_port, credentials and data_dir)."""

    kind: ClassVar[str] = "s3"
    profile: ClassVar[str] = "s3proxy"
    config_name: ClassVar[str] = "s3proxy.properties"
    log_name: ClassVar[str] = "s3proxy.log"
    pid_name: ClassVar[str] = "s3proxy.pid"
    public: bool = False  # serve on every interface (its own host in a run across hosts), not loopback only

    def label(self) -> str:
        return f"s3proxy on 127.0.0.1:{self.settings.s3_port}"

    @property
    def objects_dir(self) -> Path:
        """Where the filesystem backend keeps buckets and objects."""
        return self.root / "objects"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.settings.s3_port}"

    def ports(self) -> dict[str, int]:
        return {"s3_port": self.settings.s3_port}

    def identity(self) -> dict:
        return {"port": self.settings.s3_port}

    def prepare(self) -> list[str]:
        self.objects_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(render_properties(s3proxy_properties(self.settings, self.objects_dir, "0.0.0.0" if self.public else "127.0.0.1")))
        self.config_file.chmod(0o600)  # it holds the S3 secret key
        (self.root / "logback.xml").write_text(_LOGBACK.format(log=self.log_file))
        return ["org.gaul.s3proxy.Main", "--properties", str(self.config_file)]

    def jvm_properties(self) -> list[str]:
        return [f"-Dlogback.configurationFile={self.root / 'logback.xml'}"]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until s3proxy answers HTTP, then make sure the default bucket exists."""
        super().wait_ready(timeout)
        ensure_bucket(self.settings, self.endpoint)

    def answers(self) -> bool:
        # Any HTTP answer (403 for an unsigned request) means the server is serving.
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def status(self) -> dict:
        """Up/down, pid, endpoint, bucket, data directory and log file, for ``infra status``."""
        pid = self.pid()
        return {
            "up": pid is not None and self.answers(),
            "pid": pid,
            "endpoint": self.endpoint,
            "port": self.settings.s3_port,
            "bucket": self.settings.s3_bucket,
            "data_dir": str(self.objects_dir),
            "log": str(self.log_file),
        }


@dataclass
class S3ReadServer(S3Server):
    """A read-only s3proxy over the same object directory, with its own identity (secure stack).

    s3proxy serves exactly one identity per instance, so checkpoint readers (engines, eval) get a
    second instance on ``s3_read_port`` with ``s3proxy.read-only-blobstore=true``: any write, delete or
    bucket creation through it is refused, whatever credentials the reader holds.
    ``settings`` is the reader's view: s3_port = the read port, s3 keys = the reader's identity.
    """

    kind: ClassVar[str] = "s3-read"

    @property
    def objects_dir(self) -> Path:
        return self.settings.data_dir / "s3" / "objects"  # the writer's objects, shared

    def prepare(self) -> list[str]:
        main = super().prepare()
        with self.config_file.open("a") as f:
            f.write("s3proxy.read-only-blobstore=true\n")
        return main

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until it answers (the writer instance creates the bucket; this one cannot)."""
        JavaServer.wait_ready(self, timeout)


def ensure_bucket(settings: Settings, endpoint: str | None = None) -> bool:
    """Create ``settings.s3_bucket`` unless it exists; True when it was created.

    Created with an explicit LocationConstraint in a non-default region: s3fs's own ``mkdir`` decides
    existence from a probe that some servers answer ambiguously (see stack notes).
    """
    import s3fs

    fs = s3fs.S3FileSystem(
        key=settings.s3_access_key, secret=settings.s3_secret_key,
        client_kwargs={"endpoint_url": endpoint or settings.s3_endpoint_url, "region_name": settings.s3_region},
    )
    try:
        fs.call_s3("create_bucket", Bucket=settings.s3_bucket,
                   CreateBucketConfiguration={"LocationConstraint": settings.s3_region})
    except FileExistsError:  # BucketAlreadyOwnedByYou / BucketAlreadyExists
        return False
    except PermissionError as e:
        raise InfraError(f"s3: creating bucket {settings.s3_bucket!r} was refused ({e}); check s3_access_key/s3_secret_key") from None
    return True
