"""How new weights reach the engines: storage (engines load a checkpoint URL: ``storage``), in memory over a
process group (``broadcast``, our engine's and vLLM's routes) and vLLM's own trainer API (``vllm_api``)."""
