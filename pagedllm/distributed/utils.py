"""Which layers a pipeline stage holds."""

from __future__ import annotations

from pagedllm import envs

PP_LAYER_PARTITION_ENV = "PAGEDLLM_PP_LAYER_PARTITION"


def get_pp_indices(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """[start, end) of the decoder layers of `stage`. Even shares; the layers left over go one each
    to the stages before the last, from the last-but-one backwards (the last stage also runs the
    norm, the LM head and the sampler). `PAGEDLLM_PP_LAYER_PARTITION="10,14"` sets the counts."""
    override = envs.PAGEDLLM_PP_LAYER_PARTITION
    if override:
        try:
            counts = [int(x) for x in override.split(",")]
        except ValueError:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}={override!r}: expected comma-separated layer counts") from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}={override!r}: needs {num_stages} positive counts that add "
                             f"up to the model's {num_layers} layers")
    else:
        if num_layers < num_stages:
            raise ValueError(f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} layers")
        counts = [num_layers // num_stages] * num_stages
        for i in range(num_layers % num_stages):
            counts[-2 - i if num_stages > 1 else 0] += 1
    start = sum(counts[:stage])
    return start, start + counts[stage]
