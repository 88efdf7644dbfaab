"""What speculative decoding needs below the scheduler: its counters (`metrics.py`) and a tool that
makes a draft model from a checkpoint (`truncated_draft.py`). The settings live in
`pagedllm.config` (`SpeculativeConfig`), the proposers in `pagedllm.worker.spec_decode`, since
they run models and build step inputs."""
