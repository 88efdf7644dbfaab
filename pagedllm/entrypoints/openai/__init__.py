"""The OpenAI-compatible HTTP server (`pagedllm serve`): FastAPI app, request/response
schema, chat and text completions, tokenization and Prometheus metrics."""
