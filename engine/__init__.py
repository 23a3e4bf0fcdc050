"""The policy engine: a small torch server speaking vLLM's token-level API (docs/engine.md); the hub-free
models it serves are built and named in infra/models/."""
