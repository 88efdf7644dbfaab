"""The engine: the front end (`LLMEngine`, `AsyncLLM`), the engine core and the process
between them. The messages they exchange are in `pagedllm.protocol`."""
