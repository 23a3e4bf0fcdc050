"""The policy engine: a small torch server speaking vLLM's token-level API, and hub-free models (docs/engine.md)."""
