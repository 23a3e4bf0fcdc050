"""`polarstream harness install`: pinned specs, idempotence, clear failures (no npm call needed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gateway.harnesses.install import NPM_HARNESSES, install, installed_version
from polarstream.cli import app


def fake_installed(cache, name: str, version: str) -> None:
    h = NPM_HARNESSES[name]
    pkg = cache / "npm" / name / "node_modules" / h.package
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"name": h.package, "version": version}))
    exe = cache / "npm" / name / "node_modules" / ".bin" / h.bin
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\n")


def test_pins_match_the_measured_versions():
    assert {n: h.spec for n, h in NPM_HARNESSES.items()} == {
        "claude_code": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0",
        "gemini_cli": "@google/gemini-cli@0.61.0", "qwen_code": "@qwen-code/qwen-code@0.15.10",
        "opencode": "opencode-ai@1.18.33", "pi": "@mariozechner/pi-coding-agent@0.73.1"}


def test_present_version_is_not_reinstalled(tmp_path, monkeypatch):
    fake_installed(tmp_path, "pi", "0.73.1")
    monkeypatch.setenv("PATH", "/nonexistent")  # npm unreachable: only a no-op can succeed
    assert install("pi", tmp_path)["status"] == "present"
    assert installed_version("pi", tmp_path) == "0.73.1"


def test_wrong_version_or_missing_npm_fails_clearly(tmp_path, monkeypatch):
    fake_installed(tmp_path, "codex", "0.1.0")  # another version: must be (re)installed
    monkeypatch.setenv("PATH", "/nonexistent")
    r = install("codex", tmp_path)
    assert r["status"] == "failed" and "npm not found" in r["detail"]
    with pytest.raises(ValueError, match="unknown npm harness 'vim'"):
        install("vim", tmp_path)


def test_cli_reports_each_harness(tmp_path, monkeypatch):
    fake_installed(tmp_path, "qwen_code", "0.15.10")
    monkeypatch.setenv("POLAR_CACHE_DIR", str(tmp_path))
    res = CliRunner().invoke(app, ["harness", "install", "qwen_code"])
    assert res.exit_code == 0 and "qwen_code" in res.output and "present" in res.output
    res = CliRunner().invoke(app, ["harness", "list"])
    assert "qwen_code" in res.output and "installed" in res.output and "missing" in res.output
