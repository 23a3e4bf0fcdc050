"""A small, generated training corpus for the tiny model's tokenizer.

The tokenizer is trained on this text so that the things agents actually exchange (Python and shell,
JSON tool calls, file paths, English instructions) split into sensible tokens. The corpus is generated
from a seed with ``random.Random``, whose sequence is stable across Python versions, so the tokenizer
(and therefore the whole model directory) is byte-identical across builds.
"""

from __future__ import annotations

import json
import random

from .words import CODE, ENGLISH

_WORDS = ENGLISH.split()
_CODE = CODE.split()


def _ident(r: random.Random) -> str:
    """A snake_case, camelCase or plain identifier built from real words."""
    a, b = r.choice(_CODE + _WORDS), r.choice(_WORDS)
    return r.choice((a, a, f"{a}_{b}", f"{a}{b.capitalize()}", f"{a.capitalize()}{b.capitalize()}", f"{a}_{r.randint(0, 9)}"))


def _func(r: random.Random) -> str:
    return f"{r.choice(_CODE + _WORDS)}_{r.choice(_WORDS)}"


def _number(r: random.Random) -> str:
    return r.choice((str(r.randint(0, 100)), str(r.randint(0, 100000)), f"{r.random():.3f}", hex(r.getrandbits(32))))


def _file(r: random.Random) -> str:
    ext = r.choice(("py", "py", "js", "ts", "md", "txt", "json", "yaml", "sh", "rs", "go", "toml", "cfg"))
    parts = [r.choice(("src", "tests", "docs", "lib", "app", "scripts", "pkg", "")) or r.choice(_WORDS)]
    return "/".join(parts[: r.randint(0, 1)] + [f"{r.choice(_WORDS)}_{r.choice(_CODE)}.{ext}"])


_SHELL = (
    "ls -la", "cd src", "pwd", "cat README.md", "mkdir -p build", "rm -rf build", "git status", "git diff",
    "git log --oneline -5", "git add -A", "git commit -m 'fix tests'", "python -m pytest -q", "python main.py",
    "pip install -e .", "npm install", "npm test", "echo hello > hello.txt", "grep -rn TODO .", "make test",
    "find . -name '*.py'", "wc -l *.py", "head -n 20 app.py", "tail -f log.txt", "chmod +x run.sh",
    "export PATH=$HOME/bin:$PATH", "python3 -c 'print(1+1)'", "sed -i 's/foo/bar/g' config.yaml",
)

_TOOLS = ("bash", "read_file", "write_file", "edit_file", "list_dir", "search", "run_tests", "str_replace")



def _sentence(r: random.Random) -> str:
    words = [r.choice(_WORDS) + r.choice(("", "", "", "", "s", "ed", "ing")) for _ in range(r.randint(4, 16))]
    if r.random() < 0.3:
        words.insert(r.randint(0, len(words)), r.choice((f"`{_file(r)}`", f"`{_ident(r)}`", _number(r))))
    return words[0].capitalize() + " " + " ".join(words[1:]) + r.choice((".", ".", ".", "?", "!", ":"))


def _python(r: random.Random) -> str:
    f, a, b = _func(r), _ident(r), _ident(r)
    body = r.choice((
        f"    return {a} + {b}\n",
        f"    for {a} in range({_number(r)}):\n        print({a})\n    return None\n",
        f"    if {a} is None:\n        raise ValueError(\"{a} is required\")\n    return [{b} for {b} in {a}]\n",
        f"    with open({a}, \"r\", encoding=\"utf-8\") as f:\n        return f.read()\n",
        f"    {b} = {{}}\n    for k, v in {a}.items():\n        {b}[k] = v * {_number(r)}\n    return {b}\n",
        f"    try:\n        return int({a})\n    except (TypeError, ValueError):\n        return 0\n",
        f"    self.{a} = {b}\n    self._{_ident(r)} = []\n",
        f"    assert {f}({_number(r)}) == {_number(r)}\n",
    ))
    head = r.choice(("", "import os\nimport sys\n\n\n", "from pathlib import Path\n\n\n", "import json\n\n\n",
                     f"from {r.choice(_CODE)} import {_ident(r)}\n\n\n", f"class {_ident(r).capitalize()}:\n"))
    tail = r.choice(("", f"\n\nif __name__ == \"__main__\":\n    print({f}({_number(r)}, {_number(r)}))\n"))
    return f"{head}def {f}({a}, {b}=None):\n    \"\"\"{_sentence(r)}\"\"\"\n{body}{tail}"


def _javascript(r: random.Random) -> str:
    f, a = _func(r), _ident(r)
    return (f"const {a} = require('./{_ident(r)}');\n\nfunction {f}({a}) {{\n"
            f"  if (!{a}) {{\n    return null;\n  }}\n  return {a}.map((x) => x * {_number(r)});\n}}\n\n"
            f"module.exports = {{ {f} }};\n")


def _shell_line(r: random.Random) -> str:
    return r.choice(_SHELL + (f"cat {_file(r)}", f"python {_file(r)}", f"grep -rn {r.choice(_WORDS)} {_file(r)}",
                              f"mkdir -p {r.choice(_WORDS)}/{r.choice(_WORDS)}", f"ls {r.choice(_WORDS)}"))


def _shell(r: random.Random) -> str:
    return "\n".join(f"$ {_shell_line(r)}" for _ in range(r.randint(1, 4))) + "\n"


def _arguments(r: random.Random, tool: str) -> dict:
    if tool == "bash":
        return {"command": _shell_line(r)}
    if tool in ("write_file", "edit_file"):
        return {"path": _file(r), "content": r.choice((_sentence(r) + "\n", _python(r)))}
    if tool == "str_replace":
        return {"path": _file(r), "old_str": _ident(r), "new_str": _ident(r)}
    if tool == "search":
        return {"pattern": r.choice(_WORDS), "path": "."}
    return {"path": _file(r)}


def _tool_turn(r: random.Random) -> str:
    tool = r.choice(_TOOLS)
    call = json.dumps({"name": tool, "arguments": _arguments(r, tool)}, ensure_ascii=False)
    result = r.choice((_sentence(r), "OK", json.dumps({"ok": True, "lines": r.randint(1, 300)}), _shell(r)))
    return (f"<|im_start|>user\n{_sentence(r)}<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call>"
            f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\n{_sentence(r)}<|im_end|>\n")


def _json_doc(r: random.Random) -> str:
    doc = {_ident(r): r.choice((r.randint(0, 1000), r.choice(_WORDS), True, None, [1, 2, 3], _file(r)))
           for _ in range(r.randint(2, 6))}
    return json.dumps(doc, indent=r.choice((None, 2))) + "\n"


def _prose(r: random.Random) -> str:
    return " ".join(_sentence(r) for _ in range(r.randint(2, 6))) + "\n"


_KINDS = (_python, _python, _javascript, _shell, _tool_turn, _tool_turn, _json_doc, _prose, _prose, _prose)


def generate_corpus(seed: int, n_docs: int = 4000) -> list[str]:
    """``n_docs`` documents mixing code, shell, JSON tool calls and English, deterministic in ``seed``."""
    r = random.Random(seed)
    return [r.choice(_KINDS)(r) for _ in range(n_docs)]
