"""ini-to-env: /app/service.env holds service.ini's settings as NAME=value lines, sorted."""
from pathlib import Path

OUT = Path("/app/service.env")

EXPECTED = [
    "DB_HOST=db.internal",
    "DB_LOG_LEVEL=info",
    "DB_MAX_CONNS=20",
    "DB_PORT=5432",
    "DB_TIMEOUT=30",
    "DB_URL=postgres://${host}:${port}/app",
    "HTTP_LOG_LEVEL=info",
    "HTTP_PORT=8080",
    "HTTP_TIMEOUT=5",
    "HTTP_TLS_CERT=/etc/ssl/service.pem",
]


def test_env_file_exists():
    assert OUT.exists(), f"{OUT} does not exist"


def test_env_lines_are_the_settings_sorted():
    lines = [ln for ln in OUT.read_text().splitlines() if ln.strip()]
    assert lines == EXPECTED, lines
