"""The one line ``polarstream`` prints for a failure it expects: bad input, or a service not there.

The root command (polarstream/cli.py) catches what any subcommand raises and asks ``explain`` for
that line. The failures it expects, and what each becomes after ``error: ``::

    InfraError (infra/errors.py)        its message: Kafka, S3, an engine or gateway unreachable
                                        (infra/reach.py), a port in use, a stack that cannot start
    OSError naming a file               no such file or directory: PATH (permission denied: PATH, ...)
    OSError with a message only         the message: a model that is neither a local directory nor a
                                        hub id (infra/models/), AccessDenied (infra/security.py)
    TaskSourceError (producers/tasks)   its message: a task file or directory that holds no usable tasks
    yaml.YAMLError                      malformed YAML in FILE, line L, column C: PROBLEM
    json.JSONDecodeError                malformed JSON: MESSAGE: line L column C (char N)
    pydantic ValidationError of a
      *Settings or *Config model        invalid Settings: FIELD: MESSAGE
    httpx ConnectError/ConnectTimeout   cannot reach URL (REASON)
    httpx HTTPStatusError 401/403       URL refused the credentials (HTTP 401)
    confluent_kafka KafkaException      kafka refused the credentials / access, cannot reach Kafka

``explain`` returns None for anything else: a bug keeps its traceback. ``--debug`` (POLAR_DEBUG=1)
keeps the traceback of the expected failures too.

Library modules are looked up in ``sys.modules`` instead of imported: an exception of a library
that was never imported cannot have been raised, and ``polarstream --help`` stays fast.
"""

from __future__ import annotations

import errno
import json
import sys

from infra.errors import InfraError
from infra.reach import INFRA_HINT

_UNREACHABLE = {"_TRANSPORT", "_ALL_BROKERS_DOWN", "_RESOLVE", "_TIMED_OUT"}


def explain(exc: BaseException) -> str | None:
    """One line for an expected failure, or None when ``exc`` looks like a bug."""
    if isinstance(exc, InfraError):
        return str(exc)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, json.JSONDecodeError):
        return f"malformed JSON: {exc}"
    mods = sys.modules
    if (tasks := mods.get("producers.tasks")) and isinstance(exc, tasks.TaskSourceError):
        return str(exc)
    if (yaml := mods.get("yaml")) and isinstance(exc, yaml.YAMLError):
        return _yaml_error(exc)
    if (pydantic := mods.get("pydantic")) and isinstance(exc, pydantic.ValidationError):
        return _validation_error(exc)
    if (httpx := mods.get("httpx")) and isinstance(exc, httpx.HTTPError):
        return _http_error(exc, httpx)
    if (kafka := mods.get("confluent_kafka")) and isinstance(exc, kafka.KafkaException):
        return _kafka_error(exc)
    return None


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(message.split())


def _os_error(exc: OSError) -> str:
    if exc.filename is not None:
        what = exc.strerror or type(exc).__name__
        to = f" -> {exc.filename2}" if exc.filename2 is not None else ""
        return f"{what[0].lower()}{what[1:]}: {exc.filename}{to}"
    if exc.errno == errno.EADDRINUSE:
        return f"address already in use ({exc.strerror}); stop what holds the port or choose another with --port"
    if exc.errno is not None:  # e.g. a socket's: "Connection refused"
        return exc.strerror or str(exc)
    return str(exc) or type(exc).__name__  # raised with a message of its own


def _yaml_error(exc) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"malformed YAML: {problem}"
    return f"malformed YAML in {mark.name}, line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _validation_error(exc) -> str | None:
    # Settings and command configs are built from what the user typed; any other model failing
    # validation is a record the code itself built wrong, which is a bug.
    if not exc.title.endswith(("Settings", "Config")):
        return None
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    from .driver.experiment import given  # the experiment file's errors name the value the same way

    return f"invalid {exc.title}: {where}: {first['msg']}{given(first)}{more}"


def _http_error(exc, httpx) -> str | None:
    try:
        url = exc.request.url
    except RuntimeError:  # raised without a request: nothing to name
        url = "the server"
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return f"cannot reach {url} ({exc or type(exc).__name__})"
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (401, 403):
        return f"{url} refused the credentials (HTTP {exc.response.status_code})"
    return None


def _kafka_error(exc) -> str | None:
    from infra.security import AUTHN_ERRORS, AUTHZ_ERRORS

    err = exc.args[0] if exc.args else None
    name, detail = (err.name(), err.str()) if hasattr(err, "name") else ("", str(exc))
    if name in AUTHN_ERRORS:
        return f"kafka refused the credentials ({detail}); check kafka_username, kafka_password and kafka_ca_file (docs/security.md)"
    if name in AUTHZ_ERRORS:
        return f"kafka refused access ({name}: {detail}); grants are in infra/acls.yaml (`polarstream infra acls --print`)"
    if name in _UNREACHABLE:
        return f"cannot reach Kafka ({detail}); {INFRA_HINT}"
    return None
