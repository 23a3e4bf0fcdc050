"""train() reads top to bottom in one sitting: under 200 lines, the weight sync behind trainer/sync/'s Syncer."""

from __future__ import annotations

import ast
from pathlib import Path

import trainer.train

LIMIT = 200


def function_lines(path: Path, name: str) -> int:
    """Lines of the top-level function ``name`` in ``path``, its decorators and docstring included (from the AST)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return node.end_lineno - first + 1
    raise AssertionError(f"no function {name} in {path}")


def test_train_stays_under_200_lines():
    n = function_lines(Path(trainer.train.__file__), "train")
    assert n < LIMIT, f"trainer/train.py train() is {n} lines (limit {LIMIT}): move a part into a named function"


def test_the_count_is_of_the_whole_function(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import x\n\n\n@deco\ndef train(a):\n    '''doc'''\n    b = 1\n\n    return b\n\n\n"
                   "def other():\n    pass\n")
    assert function_lines(src, "train") == 6
    assert function_lines(src, "other") == 2


def test_train_does_not_touch_the_sync_paths():
    """The Syncer alone reads weight_transfer* and reaches the engines, storage and broadcast paths."""
    text = Path(trainer.train.__file__).read_text()
    for word in ("weight_transfer", "WeightTransfer", "sync_weights", "sync_adapter", "Gateway", "engine_from_spec"):
        assert word not in text, f"trainer/train.py names {word}: it belongs behind trainer/sync/'s Syncer"
