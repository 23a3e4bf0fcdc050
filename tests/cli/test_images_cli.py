"""``polarstream images base NAME``: refuses a name it cannot stand in for in one line, and says what a
present base is instead of building it again (a stand-in takes a minute to build; ``--force`` does)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from polarstream.cli import app
from polarstream.images_cli import describe


@pytest.mark.parametrize("name", ["quay.io/acme/tool:1", "ubuntu:25.04", "python:3.12-slim-bookworm", "python:3.13-alpine",
                                  "debian:sid"])
def test_a_name_with_no_stand_in_is_refused_in_one_line(name):
    r = CliRunner().invoke(app, ["images", "base", name])
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: {name}: no offline stand-in for it; stand-ins are made for debian:<suite>[-slim], ubuntu:<release> "
        "(20.04, 22.04, 24.04) and python:<version>[-slim][-<suite>] of a version a Debian suite ships: "
        "3.9 (bullseye), 3.11 (bookworm), 3.13 (trixie)"]


def test_the_stand_in_says_plainly_what_it_is():
    assert describe("debian:bookworm-slim", "bookworm", []) == (
        "Debian bookworm minbase + python3 3.11 from Debian's packages, not the registry's image")
    said = describe("python:3.12-slim-bookworm", "bookworm", ["python3-pip"])
    assert "not the registry's image" in said and "its python is 3.11, not the 3.12 the name asks for" in said
    said = describe("python:3.13-slim-bookworm", "trixie", ["python3-pip"])
    assert said.startswith("Debian trixie minbase + python3 3.13") and "its python is" not in said
    assert describe("ubuntu:24.04", "trixie", []).endswith("; Debian, not Ubuntu (Ubuntu's package versions may differ)")


@pytest.mark.integration
def test_a_present_base_is_not_built_again(podman_base):
    r = CliRunner().invoke(app, ["images", "base", podman_base])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"{podman_base} is present") and "--force builds the stand-in again" in r.stdout
    assert "building" not in r.stdout
