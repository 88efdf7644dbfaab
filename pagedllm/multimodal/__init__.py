"""Images into prompts: loading and checking them (`image.py`), the checkpoint's own transformers
processor turning a prompt and its images into token ids with placeholder runs and pixel arrays
(`processing.py`), and the cache of processed images the front end shares with the engine core
(`cache.py`). Nothing here runs a model: the encoder runs in the worker (see docs/multimodal.md)."""
