"""Speculative-decoding proposers: they run models and build step inputs, so they are worker code."""
