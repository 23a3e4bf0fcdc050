"""The torch GRPO trainer: polar.groups in; checkpoints, PolicyVersion and engine weights out.

Modules: ``train`` (the loop, top to bottom), ``packing`` and ``loss`` (pure functions), ``step`` (one
training step: samples to an update or a skip), ``selection`` (dedupe, staleness), ``checkpoint``
(fsspec, manifest last), ``kafka_io`` (exact-offset consumer), ``sync`` (weights to the engines, gateway stamps),
``metrics`` (JSONL, TensorBoard, progress), ``config`` (every setting), ``cli`` (``polarstream train``).
See docs/trainer.md.
"""
