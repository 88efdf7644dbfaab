"""The ground floor for model files: resolving a model name or path (the default model, a GGUF
converted once into a cached HF directory), the tokenizer and safetensors reading. Imports nothing
above it, so config, model_executor and the engine can all build on it (as vLLM's
`transformers_utils`)."""
