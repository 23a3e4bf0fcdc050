"""Site settings: what a host needs to reach its package mirrors, carried into image builds and session
containers (shared/docs/containers.md, docs/rollout.md "Air-gapped sites and TLS proxies").

Many clusters reach PyPI, Debian and npm only through a TLS proxy whose CA only the host trusts, or
through an index mirror named in pip's settings. A container has neither: pip, uv and curl fail there with
``CERTIFICATE_VERIFY_FAILED`` or go to an index they cannot reach. So the host's CA bundle (pip's ``cert``,
or ``SSL_CERT_FILE``/``REQUESTS_CA_BUNDLE``/``PIP_CERT``), its proxy variables and its package-index
settings go in: the bundle mounted read-only at ``CA_PATH``; in a session container the rest as the
environment variables each tool reads, in a build (whose RUN steps take no variables from outside) as
pip's and apt's config files, mounted. Nothing of it goes into a built image's layers or config.

    site = host_site("auto")       # "off": none of it
    site.env()                     # {"SSL_CERT_FILE": CA_PATH, "PIP_CERT": CA_PATH, ..., "PIP_INDEX_URL": ...}
    site.run_args(scratch)         # podman run's -v/-e for a session container
    site.build_args(scratch)       # podman build's --volume/--build-arg for its RUN steps
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

MODES = ("auto", "off")
# Where the host's bundle is seen inside: beside Debian's own bundle, not over it (a RUN step that installs
# ca-certificates rewrites /etc/ssl/certs/ca-certificates.crt, which a bind mount there would forbid).
CA_PATH = "/etc/ssl/polarstream-site-ca.pem"
# Every name a common tool reads its CA bundle from: Python's ssl and uv, pip, requests, curl, git, Node.
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "NODE_EXTRA_CA_CERTS")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
LOOPBACK = ("localhost", "127.0.0.1", "::1")
# pip's settings that name where packages come from (``pip config``'s key -> the variable pip reads).
PIP_KEYS = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL", "trusted-host": "PIP_TRUSTED_HOST"}
PIP_CONF = "/etc/xdg/pip/pip.conf"
APT_CONF = "/etc/apt/apt.conf.d/99polarstream-site-ca"
UV_VARS = ("UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX", "UV_INSECURE_HOST")


@dataclass(frozen=True)
class SiteSettings:
    """The host's CA bundle (a host path, "" for none), proxy variables and package-index variables."""

    ca_bundle: str = ""
    proxy: dict[str, str] = field(default_factory=dict)
    index: dict[str, str] = field(default_factory=dict)  # PIP_* and UV_* variables

    def __bool__(self) -> bool:
        return bool(self.ca_bundle or self.proxy or self.index)

    def env(self) -> dict[str, str]:
        """The variables a container's programs read (the CA ones name ``CA_PATH``, where it is mounted)."""
        return {**{k: CA_PATH for k in CA_VARS if self.ca_bundle}, **self.proxy, **self.index}

    def mounts(self) -> list[str]:
        return [f"{self.ca_bundle}:{CA_PATH}:ro"] if self.ca_bundle else []

    def run_args(self, scratch: Path) -> list[str]:
        """``podman run`` arguments: the bundle mounted read-only, the variables set for every exec, and
        apt's conf.d file (apt reads no variable for its CA; written under ``scratch``, which must
        outlive the container)."""
        args = [a for m in self.mounts() for a in ("-v", m)]
        if APT_CONF in (files := self.build_files()):
            (host := scratch / "site-apt.conf").write_text(files[APT_CONF])
            args += ["-v", f"{host}:{APT_CONF}:ro"]
        return args + [a for k, v in sorted(self.env().items()) for a in ("-e", f"{k}={v}")]

    def build_files(self) -> dict[str, str]:
        """Config files for a build's RUN steps, by the path they are mounted at: podman 4.3's ``build
        --env`` reaches the image's config but not its RUN steps, and ``--build-arg`` only a declared ARG,
        so pip learns the bundle and index from a site-wide pip.conf (/etc/xdg's: an image's own
        /etc/pip.conf still wins) and apt from a conf.d file."""
        pip = [f"cert = {CA_PATH}"] if self.ca_bundle else []
        pip += [f"{key} = {self.index[var]}" for key, var in PIP_KEYS.items() if var in self.index]
        files = {PIP_CONF: "[global]\n" + "".join(f"{line}\n" for line in pip)} if pip else {}
        if self.ca_bundle:
            files[APT_CONF] = f'Acquire::https::CAInfo "{CA_PATH}";\n'
        return files

    def build_args(self, scratch: Path, mounts: bool = True) -> list[str]:
        """``podman build`` arguments for its RUN steps (the files of ``build_files`` written under
        ``scratch``), none of it kept in the image: mounts are not layers (an empty file may stay where
        one was mounted), and proxies go as build args, which Dockerfiles predefine and images never keep.
        ``mounts`` False: proxies only (``docker build`` mounts nothing into RUN steps)."""
        args = [a for m in self.mounts() for a in ("--volume", m)] if mounts else []
        for i, (seen_at, text) in enumerate(sorted(self.build_files().items()) if mounts else []):
            (host := scratch / f"site-{i}").write_text(text)
            args += ["--volume", f"{host}:{seen_at}:ro"]
        return args + [a for k, v in sorted(self.proxy.items()) for a in ("--build-arg", f"{k}={v}")]


def parse_pip_config(text: str) -> dict[str, str]:
    """``pip config list``'s lines (``global.cert='/etc/ssl/...'``, ``:env:.index-url='...'``) as key ->
    value; the environment's (``:env:``) wins over a file's, as in pip."""
    found: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        name, eq, value = line.partition("=")
        if not eq or "." not in name:
            continue
        section, _, key = name.strip().rpartition(".")
        rank = {":env:": 3, "global": 1, "install": 2, "download": 2}.get(section)
        if rank is None:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, value)
    return {k: v for k, (_, v) in found.items()}


def read_site(environ: Mapping[str, str], pip_config: Mapping[str, str]) -> SiteSettings:
    """The site settings of a host whose environment is ``environ`` and whose ``pip config`` says
    ``pip_config``: pip's ``cert`` first (what pip on the host trusts), then the variables other tools read."""
    ca = next((c for c in (pip_config.get("cert"), *(environ.get(k) for k in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")))
               if c and Path(c).is_file()), "")
    proxy = {}
    for k in PROXY_VARS:  # both spellings: curl reads only the lower-case http_proxy
        if v := environ.get(k) or environ.get(k.lower()):
            proxy[k] = proxy[k.lower()] = v
    if proxy.keys() - {"NO_PROXY", "no_proxy"}:
        # the gateway is at the container's own loopback (the tunnel): a harness must not ask the proxy for it
        hosts = [h for h in (proxy.get("NO_PROXY") or "").split(",") if h.strip()]
        proxy["NO_PROXY"] = proxy["no_proxy"] = ",".join(dict.fromkeys([*hosts, *LOOPBACK]))
    index = {var: pip_config[key] for key, var in PIP_KEYS.items() if pip_config.get(key)}
    index.update({k: environ[k] for k in UV_VARS if environ.get(k)})
    # uv reads its own variable; a pip mirror is the site's mirror for uv too
    if "PIP_INDEX_URL" in index and not {"UV_INDEX_URL", "UV_DEFAULT_INDEX"} & index.keys():
        index["UV_DEFAULT_INDEX"] = index["PIP_INDEX_URL"]
    return SiteSettings(str(Path(ca).resolve()) if ca else "", proxy, index)


@functools.lru_cache(maxsize=None)
def _host_site() -> SiteSettings:
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""  # no pip here: the environment's variables still count
    return read_site(os.environ, parse_pip_config(out))


def site_mode(mode: str | None = None) -> str:
    """``mode`` checked (None or "": ``POLAR_SITE_SETTINGS``, else ``auto``); ValueError names the setting."""
    mode = mode or os.environ.get("POLAR_SITE_SETTINGS") or "auto"
    if mode not in MODES:
        raise ValueError(f"site_settings: {mode!r} is not one of {', '.join(MODES)}")
    return mode


def host_site(mode: str | None = None) -> SiteSettings:
    """This host's site settings (``auto``, the default: whatever it has; ``off``: none); ``site_mode``."""
    return _host_site() if site_mode(mode) == "auto" else SiteSettings()
