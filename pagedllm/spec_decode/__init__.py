"""Speculative decoding, in one package: the proposers (`ngram_proposer.py`, `draft_model.py`),
the verification of their drafts (`rejection_sampler.py`), the scheduler's rules for lookahead
slots and admissible drafts (`drafts.py`), the counters (`metrics.py`) and a tool that makes a
draft model from a checkpoint (`truncated_draft.py`). The settings live in `pagedllm.config`
(`SpeculativeConfig`); the model runner calls the proposers and the verification, and hands the
draft model its step-input builder."""
