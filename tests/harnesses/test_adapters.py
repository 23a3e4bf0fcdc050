"""Each adapter produces the recipe measured in shared/docs/harnesses.md (argv, env, config files)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from gateway.harnesses import ADAPTERS, HarnessConfigError, HarnessContext, HarnessNotInstalled, launch
from gateway.harnesses.install import NPM_HARNESSES, bin_path

BASE = "http://127.0.0.1:18100"
KEY = "sk-polar-abc.def"


@pytest.fixture
def fake_cache(tmp_path: Path) -> Path:
    """An npm cache with an executable placeholder for every CLI (adapters only need the path)."""
    for h in NPM_HARNESSES.values():
        exe = tmp_path / "npm" / h.name / "node_modules" / ".bin" / h.bin
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
    return tmp_path


def ctx(cache: Path, **config) -> HarnessContext:
    return HarnessContext(base_url=BASE, session_key=KEY, model="polar-model", instruction="Create hello.txt containing hi",
                          workspace="/workspace", home="/home/agent", cache_dir=cache, config=config, session_id="t.s0")


def test_claude_code_recipe(fake_cache):
    l = launch("claude_code", ctx(fake_cache))
    assert l.argv[0] == str(bin_path("claude_code", fake_cache))
    assert l.argv[1:3] == ["-p", "Create hello.txt containing hi"] and "--dangerously-skip-permissions" in l.argv
    assert l.env["ANTHROPIC_BASE_URL"] == BASE and l.env["ANTHROPIC_API_KEY"] == KEY
    assert l.env["ANTHROPIC_MODEL"] == l.env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "polar-model"
    assert l.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and l.env["IS_SANDBOX"] == "1"
    assert l.api == "anthropic.messages" and l.ro_paths == [fake_cache / "npm" / "claude_code"]
    allowed = launch("claude_code", ctx(fake_cache, allowed_tools=["Bash", "Write"]))
    assert "--dangerously-skip-permissions" not in allowed.argv and allowed.argv[3:6] == ["--allowedTools", "Bash", "Write"]


def test_codex_config_is_valid_toml_with_responses_provider(fake_cache):
    l = launch("codex", ctx(fake_cache))
    cfg = tomllib.loads(l.files[".codex/config.toml"])
    assert cfg["model"] == "polar-model" and cfg["model_provider"] == "polar"
    prov = cfg["model_providers"]["polar"]
    assert prov == {"name": "polarstream gateway", "base_url": f"{BASE}/v1", "env_key": "POLAR_API_KEY", "wire_api": "responses"}
    assert l.env["POLAR_API_KEY"] == KEY and l.env["CODEX_HOME"] == "/home/agent/.codex"
    assert l.argv[1:4] == ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    assert l.argv[-1] == "Create hello.txt containing hi"
    assert "-s" in launch("codex", ctx(fake_cache, sandbox="workspace-write")).argv


def test_gemini_settings_and_flags(fake_cache):
    l = launch("gemini_cli", ctx(fake_cache))
    assert json.loads(l.files[".gemini/settings.json"])["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert l.env["GOOGLE_GEMINI_BASE_URL"] == BASE and l.env["GEMINI_API_KEY"] == KEY
    assert l.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    assert l.argv[1:3] == ["-m", "polar-model"] and "--yolo" in l.argv  # -m: no router side request
    assert "-m" not in launch("gemini_cli", ctx(fake_cache, router=True)).argv


def test_qwen_env(fake_cache):
    l = launch("qwen_code", ctx(fake_cache))
    assert (l.env["OPENAI_BASE_URL"], l.env["OPENAI_API_KEY"], l.env["OPENAI_MODEL"]) == (f"{BASE}/v1", KEY, "polar-model")
    assert l.argv[1:] == ["-p", "Create hello.txt containing hi", "--yolo"]


@pytest.mark.parametrize("api,provider,model_id", [
    ("chat", "polar", "polar/polar-model"),
    ("anthropic", "anthropic", "anthropic/claude-sonnet-4-5"),
    ("responses", "openai", "openai/gpt-5"),
])
def test_opencode_apis(fake_cache, api, provider, model_id):
    l = launch("opencode", ctx(fake_cache, api=api))
    cfg = json.loads(l.env["OPENCODE_CONFIG_CONTENT"])
    assert cfg["provider"][provider]["options"] == {"baseURL": f"{BASE}/v1", "apiKey": KEY}
    assert cfg["model"] == model_id and l.argv[1:4] == ["run", "-m", model_id]
    assert l.argv[4:] == ["Create", "hello.txt", "containing", "hi"]  # one element with spaces gets quoted


@pytest.mark.parametrize("api,pi_api,url", [
    ("chat", "openai-completions", f"{BASE}/v1"), ("responses", "openai-responses", f"{BASE}/v1"),
    ("anthropic", "anthropic-messages", BASE), ("google", "google-generative-ai", f"{BASE}/v1beta"),
])
def test_pi_all_four_apis(fake_cache, api, pi_api, url):
    l = launch("pi", ctx(fake_cache, api=api))
    providers = json.loads(l.files[".pi/agent/models.json"])["providers"]
    p = providers[f"polar-{api}"]
    assert (p["api"], p["baseUrl"], p["apiKey"], p["models"]) == (pi_api, url, KEY, [{"id": "polar-model"}])
    assert l.argv[1:5] == ["-p", "--provider", f"polar-{api}", "--model"] and l.env["PI_OFFLINE"] == "1"


def test_pi_max_tokens_caps_every_answer(fake_cache):
    models = json.loads(launch("pi", ctx(fake_cache, api="anthropic", max_tokens=48)).files[".pi/agent/models.json"])
    assert {p["models"][0]["maxTokens"] for p in models["providers"].values()} == {48}
    assert "maxTokens" not in json.loads(launch("pi", ctx(fake_cache)).files[".pi/agent/models.json"])["providers"]["polar-chat"]["models"][0]
    for bad in (0, "48", True):
        with pytest.raises(HarnessConfigError, match="harness.config.max_tokens"):
            launch("pi", ctx(fake_cache, max_tokens=bad))


def test_command_expands_placeholders_and_sets_provider_env(tmp_path):
    c = HarnessContext(base_url=BASE, session_key=KEY, model="m", instruction="do it", workspace="/w", home="/h",
                       command=("my-agent", "--task={instruction}", "{base_url}/v1", '{"json": 1}'), config={"env": {"X": 1}})
    l = launch("command", c)
    assert l.argv == ["my-agent", "--task=do it", f"{BASE}/v1", '{"json": 1}']
    assert l.env["OPENAI_API_KEY"] == l.env["ANTHROPIC_API_KEY"] == l.env["GEMINI_API_KEY"] == KEY
    assert l.env["X"] == "1" and l.env["HOME"] == "/h"
    with pytest.raises(HarnessConfigError, match="harness.command"):
        launch("command", HarnessContext(base_url=BASE, session_key=KEY, model="m", instruction="x", workspace="/w", home="/h"))


def test_builtin_copies_agent_into_home(tmp_path):
    c = HarnessContext(base_url=BASE, session_key=KEY, model="m", instruction="x", workspace="/w", home="/h", python="/usr/bin/python3",
                       config={"max_turns": 3})
    l = launch("builtin", c)
    assert l.argv == ["/usr/bin/python3", "-I", "/h/.polar/agent.py"]
    assert "def main()" in l.files[".polar/agent.py"]
    assert json.loads(l.env["POLAR_AGENT_CONFIG"])["max_turns"] == 3 and l.env["OPENAI_BASE_URL"] == f"{BASE}/v1"


def test_errors_name_the_problem(fake_cache, tmp_path):
    with pytest.raises(HarnessConfigError, match="unknown harness 'nope'"):
        launch("nope", ctx(fake_cache))
    with pytest.raises(HarnessConfigError, match=r"harness.config.api: 'grpc'"):
        launch("pi", ctx(fake_cache, api="grpc"))
    with pytest.raises(HarnessNotInstalled, match="polarstream harness install qwen_code"):
        launch("qwen_code", ctx(tmp_path / "empty"))


def test_every_harness_has_an_adapter():
    assert set(NPM_HARNESSES) | {"command", "builtin"} == set(ADAPTERS)
