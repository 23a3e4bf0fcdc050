"""The demo: the arith family run as an experiment shipped with the package (``polarstream demo`` is
``polarstream run`` of demo.yaml, preset.py).

- ``arith``: the task family (single-digit sums written to answer.txt) and its reward rule;
- ``model`` and ``warmstart``: the tiny model after a cached supervised warm start on the family;
- ``capture`` and ``shape``: a real CLI's requests captured through the gateway, so the warm start can
  continue in that CLI's own prompt and tools;
- ``learning``: the same task in one process (seeded sampling and the trainer's step), for CI and tuning.

Nothing outside this package imports it but the loop's arith defaults (polarstream/loop.py) and the CLI.
"""
