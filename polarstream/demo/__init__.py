"""The demo: the arith family run as an experiment shipped with the package (``polarstream demo`` is
``polarstream run`` of demo.yaml), and a preset of the driver (polarstream/driver/preset.py).

- ``preset``: demo.yaml with the demo's options, and what the family hands the driver (``arith_preset``);
- ``arith``: the task family (single-digit sums written to answer.txt) and its reward rule;
- ``model`` and ``warmstart``: the tiny model after a cached supervised warm start on the family;
- ``capture`` and ``shape``: a real CLI's requests captured through the gateway, so the warm start can
  continue in that CLI's own prompt and tools;
- ``learning``: the same task in one process (seeded sampling and the trainer's step), for CI and tuning.

It stands on the driver, never the reverse: nothing outside this package imports it but the CLI (its
registry of presets, polarstream/presets.py, and ``polarstream demo``), tests/schemas/test_layering.py says.
"""
