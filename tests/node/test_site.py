"""Site settings (the host's CA bundle, proxies and package index) as containers get them, the stand-in
a base image name gets, and uv's binaries out of its wheel: pure functions over given inputs."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from gateway.node.config import NodeConfig
from gateway.runtimes import ContainerRuntime
from gateway.runtimes.images import standin_recipe
from gateway.runtimes.site import APT_CONF, CA_PATH, PIP_CONF, SiteSettings, host_site, parse_pip_config, read_site
from gateway.runtimes.uvtool import ENV_SCRIPT, extract_binaries, uses_uv
from schemas import EvaluatorSpec

# What `pip config list` printed on this project's machines: the CA from /etc/pip.conf and the environment.
PIP_CONFIG_LIST = """:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
"""


@pytest.fixture
def bundle(tmp_path) -> Path:
    path = tmp_path / "site-ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n")
    return path


def test_pip_config_list_is_read_with_the_environment_over_the_files():
    assert parse_pip_config(PIP_CONFIG_LIST)["cert"] == "/etc/ssl/certs/ca-certificates.crt"
    said = parse_pip_config("global.index-url='https://mirror.example/simple'\n:env:.index-url='https://env.example/simple'\n"
                            "install.trusted-host='mirror.example'\nnot a setting\n")
    assert said == {"index-url": "https://env.example/simple", "trusted-host": "mirror.example"}


def test_the_site_ca_goes_in_under_every_name_tools_read_and_nothing_else_comes_unasked(bundle, tmp_path):
    site = read_site({}, {"cert": str(bundle)})
    assert site.ca_bundle == str(bundle.resolve())
    env = site.env()
    assert {env[k] for k in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")} == {CA_PATH}
    assert not any(k.endswith(("PROXY", "_proxy", "INDEX_URL")) for k in env)
    args = site.run_args(tmp_path)
    assert args[:4] == ["-v", f"{bundle.resolve()}:{CA_PATH}:ro", "-v", f"{tmp_path / 'site-apt.conf'}:{APT_CONF}:ro"]
    assert (tmp_path / "site-apt.conf").read_text() == f'Acquire::https::CAInfo "{CA_PATH}";\n' and f"PIP_CERT={CA_PATH}" in args


def test_a_bundle_that_is_not_there_is_not_mounted_and_the_next_one_named_is(bundle):
    assert read_site({"SSL_CERT_FILE": "/nowhere/ca.pem"}, {"cert": "/nowhere/either.pem"}) == SiteSettings()
    assert read_site({"REQUESTS_CA_BUNDLE": str(bundle)}, {"cert": "/nowhere.pem"}).ca_bundle == str(bundle.resolve())


def test_proxies_in_both_spellings_and_pips_index_for_uv_too(bundle):
    site = read_site({"https_proxy": "http://proxy:3128", "NO_PROXY": "localhost,.internal", "UV_INSECURE_HOST": "mirror"},
                     {"index-url": "https://mirror/simple", "extra-index-url": "https://extra/simple", "cert": str(bundle)})
    env = site.env()
    assert env["HTTPS_PROXY"] == env["https_proxy"] == "http://proxy:3128"
    # the gateway, at the container's loopback, is never asked of the proxy
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,.internal,127.0.0.1,::1"
    assert read_site({"NO_PROXY": "a.b"}, {}).env() == {"NO_PROXY": "a.b", "no_proxy": "a.b"}  # no proxy, nothing added
    assert env["PIP_INDEX_URL"] == env["UV_DEFAULT_INDEX"] == "https://mirror/simple"
    assert env["PIP_EXTRA_INDEX_URL"] == "https://extra/simple" and env["UV_INSECURE_HOST"] == "mirror"
    # uv's own index setting is the site's word for uv: pip's does not override it
    assert "UV_DEFAULT_INDEX" not in read_site({"UV_INDEX_URL": "https://uv/simple"}, {"index-url": "https://pip/simple"}).env()


def test_a_build_gets_pip_and_apt_config_files_mounted_and_proxies_as_build_args(bundle, tmp_path):
    site = read_site({"HTTP_PROXY": "http://proxy:3128"}, {"cert": str(bundle), "index-url": "https://mirror/simple"})
    args = site.build_args(tmp_path)
    mounts = dict(args[i + 1].rsplit(":", 1)[0].split(":", 1)[::-1] for i, a in enumerate(args) if a == "--volume")
    assert mounts[CA_PATH] == str(bundle.resolve())
    assert Path(mounts[PIP_CONF]).read_text() == f"[global]\ncert = {CA_PATH}\nindex-url = https://mirror/simple\n"
    assert Path(mounts[APT_CONF]).read_text() == f'Acquire::https::CAInfo "{CA_PATH}";\n'
    assert ["--build-arg", "HTTP_PROXY=http://proxy:3128"] == args[args.index("--build-arg"):][:2]
    assert "--env" not in args  # podman 4.3 gives --env to the image's config, not to its RUN steps
    loopback = "localhost,127.0.0.1,::1"
    assert site.build_args(tmp_path, mounts=False) == [
        "--build-arg", "HTTP_PROXY=http://proxy:3128", "--build-arg", f"NO_PROXY={loopback}",
        "--build-arg", "http_proxy=http://proxy:3128", "--build-arg", f"no_proxy={loopback}"]


def test_no_site_settings_add_nothing_and_off_is_off(tmp_path):
    assert SiteSettings().run_args(tmp_path) == [] and SiteSettings().build_args(tmp_path) == []
    assert list(tmp_path.iterdir()) == []
    assert host_site("off") == SiteSettings()
    with pytest.raises(ValueError, match="site_settings: 'on' is not one of auto, off"):
        host_site("on")


def test_the_setting_comes_from_the_node_or_the_environment_and_a_wrong_one_stops_the_node(monkeypatch, tmp_path):
    monkeypatch.setenv("POLAR_SITE_SETTINGS", "off")
    assert ContainerRuntime(None).site_settings == "off" and ContainerRuntime(None, site_settings="auto").site_settings == "auto"
    monkeypatch.delenv("POLAR_SITE_SETTINGS")
    assert ContainerRuntime(None).site_settings == "auto"
    with pytest.raises(ValueError, match="site_settings: 'yes' is not one of auto, off"):
        NodeConfig(work_dir=tmp_path, cache_dir=tmp_path, site_settings="yes")


@pytest.mark.parametrize("name, suite", [
    ("python:3.13-slim-bookworm", "trixie"),  # the python the tag names, not the suite it names
    ("python:3.13", "trixie"), ("docker.io/library/python:3.13-slim", "trixie"), ("python:3.13.1-slim-trixie", "trixie"),
    ("python:3.11", "bookworm"), ("python:3.11-slim-bookworm", "bookworm"), ("python:3.9-bullseye", "bullseye"),
    ("python:3-slim", "bookworm"), ("python:slim-trixie", "trixie"),
    ("ubuntu:24.04", "trixie"), ("ubuntu:noble", "trixie"), ("ubuntu:22.04", "bookworm"),
    ("debian:bookworm-slim", "bookworm"), ("debian:trixie", "trixie"),
])
def test_a_stand_in_carries_the_python_its_tag_names(name, suite):
    recipe = standin_recipe(name)
    assert recipe is not None and recipe[0] == suite
    assert ("python3-pip" in recipe[1]) == name.split("/")[-1].startswith("python")


@pytest.mark.parametrize("name", ["python:3.12", "python:3.12-slim-bookworm", "python:3.14-slim", "python:3.13-alpine",
                                  "python:3.13-windowsservercore", "ubuntu:25.04", "debian:sid", "quay.io/acme/python:3.13",
                                  "alexgshaw/fix-git:20251031"])
def test_no_stand_in_for_a_python_no_debian_ships_nor_another_registrys_image(name):
    assert standin_recipe(name) is None


def test_uv_and_uvx_come_out_of_the_wheel_with_the_installers_env_file(tmp_path):
    wheel = tmp_path / "uv-0.9.5-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("uv-0.9.5.data/scripts/uv", b"\x7fELF uv")
        z.writestr("uv-0.9.5.data/scripts/uvx", b"\x7fELF uvx")
        z.writestr("uv/__init__.py", "")
    dest = extract_binaries(wheel, tmp_path / "uv" / "0.9.5")
    assert (dest / "uv").read_bytes() == b"\x7fELF uv" and (dest / "uv").stat().st_mode & 0o111 == 0o111
    assert (dest / "env").read_text() == ENV_SCRIPT and 'export PATH="$HOME/.local/bin:$PATH"' in ENV_SCRIPT
    assert sorted(p.name for p in dest.parent.iterdir()) == ["0.9.5"]  # no half-extracted directory left
    broken = tmp_path / "uv-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(broken, "w") as z:
        z.writestr("uv-0.0.1.data/scripts/uv", b"uv")
    with pytest.raises(ValueError, match="no uvx in it"):
        extract_binaries(broken, tmp_path / "uv" / "0.0.1")


def test_uv_goes_in_only_for_a_verifier_that_calls_it():
    def spec(test_sh: str) -> EvaluatorSpec:
        return EvaluatorSpec(kind="harbor", command="bash /tests/test.sh", tests={"test.sh": test_sh, "test_outputs.py": "x = 1"})

    assert uses_uv(spec("curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nuvx -p 3.13 -w pytest==8.4.1 pytest"))
    assert uses_uv(spec("uv run pytest /tests"))
    assert not uses_uv(spec("python3 -m pytest /tests  # the uvula test"))


def test_a_task_image_built_on_a_stand_in_is_tagged_by_the_stand_ins_recipe_too(monkeypatch):
    from gateway.runtimes import images

    on_standin = {"Dockerfile": b"FROM python:3.13-slim-bookworm AS build\nFROM build\nRUN true\n"}
    elsewhere = {"Dockerfile": b"FROM quay.io/acme/tool:1\nRUN true\n"}
    assert images.task_tag(elsewhere) == f"{images.TAG_REPO}:{images.context_hash(elsewhere)}"
    before = images.task_tag(on_standin)
    assert before != f"{images.TAG_REPO}:{images.context_hash(on_standin)}"
    monkeypatch.setattr(images, "RECIPE_VERSION", images.RECIPE_VERSION + 1)  # the stand-ins' recipe changes
    assert images.task_tag(on_standin) != before and images.task_tag(elsewhere) == f"{images.TAG_REPO}:{images.context_hash(elsewhere)}"


def test_the_cached_uv_wheel_taken_is_this_machines_glibc_one(tmp_path):
    import platform

    from gateway.runtimes.uvtool import _wheels

    arch, other = platform.machine(), "aarch64" if platform.machine() != "aarch64" else "x86_64"
    names = [f"uv-0.9.5-py3-none-musllinux_1_1_{arch}.whl", f"uv-0.9.5-py3-none-manylinux_2_17_{other}.manylinux2014_{other}.whl",
             f"uv-0.9.4-py3-none-manylinux_2_17_{arch}.manylinux2014_{arch}.whl"]
    for name in names:
        (tmp_path / name).touch()
    assert _wheels(tmp_path, "0.9.5") == []
    (mine := tmp_path / f"uv-0.9.5-py3-none-manylinux_2_17_{arch}.manylinux2014_{arch}.whl").touch()
    assert _wheels(tmp_path, "0.9.5") == [mine]
