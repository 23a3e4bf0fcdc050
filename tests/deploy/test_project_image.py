"""The project's image (polarstream/project_image.py): what goes in (unit), and, marked ``containers`` (not in
`make test`: the first build copies a 5 GB venv; `make containers-test`), that it builds offline, twice to one id,
and runs the components' programs: python with torch, the JRE, bwrap with the node's podman flags."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from polarstream.project_image import LABEL, build_project_image, image_id, runtime_dists, venv_files

ROOT = Path(__file__).parents[2]


def test_the_venv_in_the_image_is_the_runtime_closure_with_torchs_cuda_extras_and_no_test_tools():
    dists = runtime_dists()
    assert {"torch", "confluent-kafka", "faust-streaming", "s3fs", "transformers"} <= set(dists)
    # torch asks for its CUDA runtime as cuda-toolkit[cudart,...]: only following the extras brings it
    assert {"nvidia-cuda-runtime", "nvidia-cublas"} <= set(dists)
    assert not {"pytest", "atheris", "hypothesis", "kubernetes-validate"} & set(dists)  # the test extra's
    files = venv_files(dists, Path(sysconfig.get_paths()["purelib"]))
    assert "torch/__init__.py" in files
    assert not [f for f in files if "__pycache__" in f or f.startswith("__editable__")]


def _podman(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    from gateway.runtimes.images import engine_argv

    return subprocess.run([*engine_argv("podman"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.containers
def test_the_image_builds_twice_to_one_id_and_runs_every_components_programs():
    assert shutil.which("podman") and shutil.which("mmdebstrap"), "run `make system` (apt-get install podman runc mmdebstrap)"
    # two builds from nothing (--no-cache: every layer made again) give one id: the same bytes and config
    tag = build_project_image(force=True)
    first = image_id(tag)
    assert build_project_image(force=True) == tag and image_id(tag) == first
    assert build_project_image() == tag and image_id(tag) == first  # and a build of the same inputs finds it
    assert _podman("image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', tag).stdout.strip() == tag.rsplit(":", 1)[1]
    run = ["run", "--rm", "--network", "none", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
           "--security-opt", "seccomp=unconfined", "--security-opt", "unmask=ALL", tag, "sh", "-c",
           "python -c 'import torch, confluent_kafka, faust, polarstream.cli; print(torch.tensor([2.0]).sum().item())' && "
           "java -version 2>&1 | head -1 && polarstream infra serve --help > /dev/null && "
           "bwrap --ro-bind / / --dev /dev --proc /proc --unshare-all --die-with-parent python3 -c 'print(\"sandboxed\")'"]
    out = _podman(*run, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() [:1] == ["2.0"] and "sandboxed" in out.stdout and "openjdk" in out.stdout
