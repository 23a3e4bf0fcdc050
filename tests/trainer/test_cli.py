"""``polarstream train`` rejects bad input with an error that names it."""

import typer
from typer.testing import CliRunner

from polarstream.cli import app


def _run(*args):
    return CliRunner().invoke(app, ["train", *args])


def _said(r) -> str:
    """The error box's text in one line (rich wraps it)."""
    return " ".join(r.output.replace("│", " ").split())


def test_unknown_setting_is_named(tmp_path):
    r = _run("--model", str(tmp_path), "--set", "clip_hgh=0.3")
    assert r.exit_code == 2 and "clip_hgh" in r.output


def test_malformed_set_and_bad_value(tmp_path):
    assert "expected key=value" in _run("--model", str(tmp_path), "--set", "lr").output
    r = _run("--model", str(tmp_path), "--set", "stale_mode=forget")
    assert r.exit_code == 2 and "stale_mode" in r.output and "downweight" in r.output


def test_model_directory_must_exist(tmp_path):
    r = _run("--model", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "no such directory (tried it as a local path" in _said(r)
    r = _run("--model", str(tmp_path))
    assert r.exit_code == 2 and "not a model directory (no config.json)" in _said(r)
    r = _run("--model", "tiny:x")
    assert r.exit_code == 2 and "bad seed" in _said(r)
    r = _run("--model", "nobody/no-model")  # a hub id: the trainer never downloads
    assert r.exit_code == 2 and "does not download hub ids" in _said(r)


def test_a_built_in_name_resolves_as_for_the_engine(monkeypatch):
    import trainer.cli
    from infra.models import ensure_model

    seen = {}

    def stop(cfg, settings):  # the services come after the model: stop there, with the resolved config
        seen["model"] = cfg.model
        raise typer.Exit(3)

    monkeypatch.setattr(trainer.cli, "_require_services", stop)
    r = _run("--model", "tiny")
    assert r.exit_code == 3, r.output
    assert seen["model"] == str(ensure_model("tiny"))
