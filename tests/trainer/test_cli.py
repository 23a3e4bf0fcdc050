"""``polarstream train`` rejects bad input with an error that names it."""

from typer.testing import CliRunner

from polarstream.cli import app


def _run(*args):
    return CliRunner().invoke(app, ["train", *args])


def test_unknown_setting_is_named(tmp_path):
    r = _run("--model", str(tmp_path), "--set", "clip_hgh=0.3")
    assert r.exit_code == 2 and "clip_hgh" in r.output


def test_malformed_set_and_bad_value(tmp_path):
    assert "expected key=value" in _run("--model", str(tmp_path), "--set", "lr").output
    r = _run("--model", str(tmp_path), "--set", "stale_mode=forget")
    assert r.exit_code == 2 and "stale_mode" in r.output and "downweight" in r.output


def test_model_directory_must_exist(tmp_path):
    r = _run("--model", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "not a model directory" in r.output
