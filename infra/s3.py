"""A real S3 API server: s3proxy (org.gaul:s3proxy) with its filesystem backend, on 127.0.0.1.

Objects live as plain files under ``<data_dir>/s3/objects/<bucket>/<key>``; requests are authenticated
(AWS signature v2 or v4) with settings' access and secret key. After start the default bucket exists.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InfraError
from .maven import classpath, jar_dir
from .process import Service, cds_archive, require_free_ports, require_java, tail
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


def s3proxy_properties(settings: Settings, objects_dir: Path) -> dict[str, str]:
    """s3proxy's --properties file for our port, credentials and object directory."""
    return {
        "s3proxy.endpoint": f"http://127.0.0.1:{settings.s3_port}",
        "s3proxy.authorization": "aws-v2-or-v4",
        "s3proxy.identity": settings.s3_access_key,
        "s3proxy.credential": settings.s3_secret_key,
        "jclouds.provider": "filesystem",
        "jclouds.filesystem.basedir": str(objects_dir),
    }


@dataclass
class S3Server:
    """The project's S3 server for one ``Settings`` (its s3_port, credentials and data_dir)."""

    settings: Settings
    heap_mb: int = 256
    die_with_parent: bool = False  # tests set it so a killed test session leaves no server behind
    quick_jit: bool = False  # C1 only: starts with half the CPU; fine for short-lived test servers
    root: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root = self.settings.data_dir / "s3"
        self.service = Service(
            name=f"s3proxy on 127.0.0.1:{self.settings.s3_port}",
            pid_file=self.root / "s3proxy.pid",
            log_file=self.root / "s3proxy.log",
            marker=str(self.config_file),
            archive=cds_archive(jar_dir("s3proxy", self.settings)),
        )

    @property
    def config_file(self) -> Path:
        """s3proxy's properties file (also the marker that identifies its process)."""
        return self.root / "s3proxy.properties"

    @property
    def objects_dir(self) -> Path:
        """Where the filesystem backend keeps buckets and objects."""
        return self.root / "objects"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.settings.s3_port}"

    def pid(self) -> int | None:
        """Pid of the running server, or None."""
        return self.service.pid()

    def start(self, timeout: float = 60.0) -> bool:
        """Start s3proxy unless it runs already, wait until it answers, ensure the default bucket."""
        started = self.launch()
        self.wait_ready(timeout)
        return started

    def launch(self) -> bool:
        """Spawn s3proxy without waiting; False when it already runs."""
        if self.pid() is not None:
            running = self.service.info() or {}
            if running.get("port") != self.settings.s3_port:
                raise InfraError(f"s3proxy from {self.root} already runs on port {running.get('port')}, not "
                                 f"{self.settings.s3_port}: run `polarstream infra down` first or use another data_dir")
            return False
        java = require_java()
        require_free_ports("s3", {"s3_port": self.settings.s3_port})
        cp = classpath("s3proxy", self.settings)
        self.objects_dir.mkdir(parents=True, exist_ok=True)
        props = s3proxy_properties(self.settings, self.objects_dir)
        self.config_file.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        logback = self.root / "logback.xml"
        logback.write_text(_LOGBACK.format(log=self.service.log_file))
        cmd = [java, *self.service.cds_flags(), f"-Xmx{self.heap_mb}m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
               *(["-XX:TieredStopAtLevel=1"] if self.quick_jit else []), f"-Dlogback.configurationFile={logback}", "-cp", cp,
               "org.gaul.s3proxy.Main", "--properties", str(self.config_file)]
        self.service.spawn(cmd, extra={"port": self.settings.s3_port}, die_with_parent=self.die_with_parent)
        return True

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until s3proxy answers HTTP, then make sure the default bucket exists."""
        self.service.wait_ready(self._answers, timeout)
        ensure_bucket(self.settings, self.endpoint)

    def _answers(self) -> bool:
        # Any HTTP answer (403 for an unsigned request) means the server is serving.
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop the server; True when one was running."""
        return self.service.stop(timeout)

    def status(self) -> dict:
        """Up/down, pid, endpoint, bucket, data directory and log file, for ``infra status``."""
        pid = self.pid()
        return {
            "up": pid is not None and self._answers(),
            "pid": pid,
            "endpoint": self.endpoint,
            "port": self.settings.s3_port,
            "bucket": self.settings.s3_bucket,
            "data_dir": str(self.objects_dir),
            "log": str(self.service.log_file),
        }

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        return tail(self.service.log_file, lines)


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
