import pytest

from semver import latest, sort_versions


@pytest.mark.parametrize("given, expected", [
    (["1.10.0", "1.9.0", "1.2.3"], ["1.2.3", "1.9.0", "1.10.0"]),
    (["10.0.0", "9.99.99"], ["9.99.99", "10.0.0"]),
    (["2.0.0", "2.0.0-rc.1", "1.0.0"], ["1.0.0", "2.0.0-rc.1", "2.0.0"]),
    (["1.0.0-rc.10", "1.0.0-rc.2", "1.0.0-beta"], ["1.0.0-beta", "1.0.0-rc.2", "1.0.0-rc.10"]),
    (["1.0.0-alpha.beta", "1.0.0-alpha.1", "1.0.0-alpha"], ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta"]),
])
def test_sort_versions(given, expected):
    assert sort_versions(given) == expected


def test_latest():
    assert latest(["0.9.1", "0.10.0", "0.10.0-rc.3"]) == "0.10.0"


def test_input_is_not_modified():
    versions = ["1.10.0", "1.9.0"]
    sort_versions(versions)
    assert versions == ["1.10.0", "1.9.0"]
