"""Which image a task runs in, decided as Harbor decides it, once at load and again where it runs.

    plan = await plan_image(env, engine)        # at load: pull, build, stand-in, or refuse (and why)
    tag, build_s = await task_image(env, engine, task_id="t")   # where the session opens: acts on it

A published Terminal-Bench 2.0 task names a prebuilt image (``[environment] docker_image``, a Docker Hub
short name) *and* ships ``environment/Dockerfile``. Harbor takes the image when it can and builds the
Dockerfile when told to (``--force-build``). Here:

- a short name resolves as Docker resolves it (``x/y:t`` is docker.io/x/y:t; podman alone refuses it);
- ``docker_image`` is pulled when its registry answers a manifest request within ``PROBE_S``; a registry
  that did not answer is remembered for ``FORGET_S``, so a process does not wait on it once per session;
- otherwise, or with ``force_build``, ``environment/Dockerfile`` is built (images.ensure_image), its
  bases pulled or, where no registry answers, made as offline Debian stand-ins (images.standin_recipe);
- a task whose image can be neither pulled nor built is refused with one line naming why; the CLI and
  the driver ask before anything starts (``plan_image``), so it is never a failure per session.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from schemas import EnvironmentSpec

from .images import (STANDIN_LABEL, ImageBuildError, _run, engine_argv, ensure_base, ensure_image, from_images,
                     image_exists, qualified, standin_recipe)
from .site import SiteSettings

log = logging.getLogger("polarstream.node")

PROBE_S = 20.0  # a registry that has not answered a manifest request by then is taken as unreachable
FORGET_S = 300.0  # how long an unreachable registry is believed so before it is asked again
# What a client says when it never reached the registry (DNS, TCP, TLS, a proxy that refused the tunnel)
_UNREACHABLE = re.compile(r"pinging container registry|dial tcp|no such host|connection refused|i/o timeout|"
                          r"network is unreachable|no route to host|TLS handshake timeout|proxyconnect|"
                          r"Client\.Timeout|context deadline exceeded", re.I)
# podman 4.3 fetches a single image's manifest, then will not print it: the registry has the image
_SINGLE = re.compile(r"Treating single images as manifest lists is not implemented")
# What a registry that answered says of an image it does not have, or will not give
_ABSENT = re.compile(r"manifest unknown|not found|name unknown|denied|unauthorized|authentication required", re.I)

UNREACHABLE, ABSENT = "registry unreachable", "not in the registry"  # why a docker_image was not pulled
_unreachable: dict[str, tuple[float, str]] = {}  # registry host -> (when it last failed to answer, what was said)
_told: set[tuple[str, str]] = set()  # (task, reason) already logged by this process: one line each


def registry(name: str) -> str:
    """The registry host of an image name, once qualified (``alexgshaw/x:1`` -> docker.io)."""
    return qualified(name).split("/", 1)[0]


@dataclass(frozen=True)
class Probe:
    """What a registry said of an image: ``pullable``, ``unreachable`` (no answer) or ``absent``."""

    state: str
    detail: str = ""


@dataclass(frozen=True)
class ImagePlan:
    """How a task gets its image. ``how``: ``local`` (in the store already), ``pull``, ``build`` (its
    Dockerfile), ``standin`` (docker_image is a Debian base we make offline) or ``refuse``. ``why``: what
    made it build rather than pull (``registry unreachable``, ``force_build``, ``not in the registry``)
    or, for ``refuse``, the one-line reason. ``standin_bases``: FROM images that will be stand-ins."""

    how: str
    why: str = ""
    image: str = ""  # the qualified docker_image, where there is one
    standin_bases: tuple[str, ...] = field(default=())

    @property
    def refused(self) -> bool:
        return self.how == "refuse"

    def label(self) -> str:
        """One token for a table column: ``pulled``, ``local``, ``built``, ``built:unreachable`` (its
        registry did not answer), ``built:absent`` (it has no such image), ``built:force_build``,
        ``standin``; ``+standin`` where a FROM base is an offline stand-in."""
        if self.how == "refuse":
            return "refused"
        text = {"pull": "pulled", "build": "built"}.get(self.how, self.how)
        if self.how == "build" and self.why:
            text += ":" + {UNREACHABLE: "unreachable", ABSENT: "absent"}.get(self.why, self.why)
        return text + ("+standin" if self.standin_bases else "")


def has_dockerfile(env: EnvironmentSpec) -> bool:
    return "Dockerfile" in env.context or bool(env.context_dir and (Path(env.context_dir) / "Dockerfile").is_file())


def _dockerfile(env: EnvironmentSpec) -> str:
    if "Dockerfile" in env.context:
        return env.context["Dockerfile"]
    return (Path(env.context_dir) / "Dockerfile").read_text(errors="replace")


async def probe(name: str, engine: str = "podman") -> Probe:
    """Ask ``name``'s registry for its manifest (``PROBE_S`` at most); a registry that did not answer is
    not asked again for ``FORGET_S`` seconds by this process."""
    host, full = registry(name), qualified(name)
    seen = _unreachable.get(host)
    if seen and time.monotonic() - seen[0] < FORGET_S:
        return Probe("unreachable", seen[1])
    rc, out = await _run([*engine_argv(engine), "manifest", "inspect", full], PROBE_S)
    # the engine's last line nests its causes ("...: dial tcp: lookup ...: no such host"): the innermost says it
    last = out.strip().splitlines()[-1].rsplit(": ", 1)[-1][:120] if out.strip() else ""
    if rc == 0 or _SINGLE.search(out):
        _unreachable.pop(host, None)
        return Probe("pullable")
    if rc is None or _UNREACHABLE.search(out):
        detail = f"{host} did not answer" + (f": {last}" if rc is not None else f" in {PROBE_S:g} s")
        _unreachable[host] = (time.monotonic(), detail)
        return Probe("unreachable", detail)
    if _ABSENT.search(out):
        return Probe("absent", last)
    # An answer we cannot read (an engine whose `manifest inspect` wants a list, say): the pull decides.
    return Probe("pullable", last)


async def _local(name: str, engine: str) -> bool:
    return await image_exists(engine, qualified(name)) or await image_exists(engine, name)


async def _is_standin(name: str, engine: str) -> bool:
    """Whether the local ``name`` is a stand-in we made; an image built FROM one inherits its label, so
    only a name a stand-in is made for counts."""
    if standin_recipe(name) is None:
        return False
    rc, out = await _run([*engine_argv(engine), "image", "inspect", "--format",
                          f'{{{{index .Labels "{STANDIN_LABEL}"}}}}', qualified(name)])
    return rc == 0 and out.strip() not in ("", "<no value>")


async def _base_plan(base: str, engine: str) -> tuple[str, str]:
    """("local" | "pull" | "standin", "") for a FROM image, or ("refuse", why)."""
    if await _local(base, engine):
        return ("standin" if await _is_standin(base, engine) else "local"), ""
    seen = await probe(base, engine)
    if seen.state == "pullable":
        return "pull", ""
    if standin_recipe(base) is None:
        return "refuse", (f"its Dockerfile's base {base} cannot be pulled ({seen.detail or seen.state}) and has no "
                          "offline stand-in (debian:<suite>, ubuntu:<release> and python:<version> of a Debian suite's python have one)")
    if not shutil.which("mmdebstrap"):
        return "refuse", f"its Dockerfile's base {base} cannot be pulled ({seen.detail}) and mmdebstrap is not installed to make a stand-in"
    return "standin", ""


async def _build_plan(env: EnvironmentSpec, engine: str, why: str, image: str) -> ImagePlan:
    bases = from_images(_dockerfile(env))
    plans = await asyncio.gather(*(_base_plan(b, engine) for b in bases))
    for base, (how, reason) in zip(bases, plans):
        if how == "refuse":
            return ImagePlan("refuse", reason, image)
    return ImagePlan("build", why, image, tuple(b for b, (how, _) in zip(bases, plans) if how == "standin"))


async def plan_image(env: EnvironmentSpec, engine: str = "podman") -> ImagePlan:
    """How ``env``'s image is got here (module docstring); ``refuse`` with one line when it cannot be."""
    dockerfile = has_dockerfile(env)
    if env.force_build:
        if not dockerfile:
            return ImagePlan("refuse", "force_build: it has no environment/Dockerfile to build", qualified(env.image) if env.image else "")
        return await _build_plan(env, engine, "force_build", qualified(env.image) if env.image else "")
    if not env.image:
        return await _build_plan(env, engine, "", "")
    image = qualified(env.image)
    if await _local(env.image, engine):
        return ImagePlan("standin" if await _is_standin(env.image, engine) else "local", "", image)
    seen = await probe(env.image, engine)
    if seen.state == "pullable":
        return ImagePlan("pull", "", image)
    why = UNREACHABLE if seen.state == "unreachable" else ABSENT
    if dockerfile:
        return await _build_plan(env, engine, why, image)
    if standin_recipe(env.image) is not None and shutil.which("mmdebstrap"):
        return ImagePlan("standin", why, image)  # docker_image is itself a Debian base: made offline
    return ImagePlan("refuse", f"cannot pull {env.image} ({seen.detail or why}) and the task has no "
                               "environment/Dockerfile to build instead", image)


async def plan_images(envs: list[EnvironmentSpec], engine: str = "podman", jobs: int = 8) -> list[ImagePlan]:
    """``plan_image`` of each, ``jobs`` at a time (a directory of 89 tasks is asked in seconds)."""
    gate = asyncio.Semaphore(jobs)

    async def one(env: EnvironmentSpec) -> ImagePlan:
        async with gate:
            return await plan_image(env, engine)

    return list(await asyncio.gather(*(one(e) for e in envs)))


def _say_once(task_id: str, text: str) -> None:
    if (task_id, text) not in _told:
        _told.add((task_id, text))
        log.warning("%s", text)


async def task_image(env: EnvironmentSpec, engine: str = "podman", *, task_id: str = "",
                     log_path: Path | None = None, site: SiteSettings | None = None) -> tuple[str, float]:
    """The image a session of the task runs in, got as ``plan_image`` says: (tag, seconds spent building).
    A docker_image whose pull fails after all falls back to the Dockerfile. ImageBuildError of one line
    when there is neither. ``site``: what a build's RUN steps get of the host's CA, proxies and index (site.py)."""
    plan = await plan_image(env, engine)
    if plan.refused:
        raise ImageBuildError(plan.why)
    if plan.how in ("local", "standin") and plan.image:  # docker_image itself, found or made offline
        return await ensure_base(plan.image, engine, log_path, pull=False), 0.0
    why = plan.why
    if plan.how == "pull":
        t0 = time.monotonic()
        rc, out = await _run([*engine_argv(engine), "pull", "-q", plan.image], env.build_timeout_s, log_path)
        if rc == 0:
            return plan.image, 0.0
        last = out.strip().splitlines()[-1][:160] if out.strip() else f"timed out after {time.monotonic() - t0:.0f} s"
        if not has_dockerfile(env):
            raise ImageBuildError(f"cannot pull {plan.image} ({last}) and the task has no environment/Dockerfile")
        why = f"pull failed: {last}"
    if plan.image:  # docker_image given, its Dockerfile built instead: say so, once per task and reason
        _say_once(task_id, f"task {task_id or '?'}: building environment/Dockerfile instead of pulling {plan.image} ({why})")
    for base in plan.standin_bases:  # made offline now: ensure_image would try to pull them first
        await ensure_base(base, engine, log_path, pull=False)
    built = env.model_copy(update={"image": ""})  # images.ensure_image builds the context of an image-less spec
    return await ensure_image(built, engine, log=log_path, site=site)


__all__ = ["FORGET_S", "PROBE_S", "ImagePlan", "Probe", "has_dockerfile", "plan_image", "plan_images", "probe", "qualified",
           "registry", "task_image"]
