"""The engine-core process builds its core with one torch thread fewer (the front parses its
tokenizer meanwhile) and gets the count back after; not with several ranks, one thread, or a
count the build chose itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.engine.core_proc import one_cpu_left_to_the_front


def _config(device: str = "cpu", world_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(device_config=SimpleNamespace(device=torch.device(device)),
                           parallel_config=SimpleNamespace(world_size=world_size))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("start, config, inside", [
    (3, _config(), 2),
    (2, _config(), 1),
    (1, _config(), 1),  # nothing to spare
    (3, _config(world_size=2), 3),  # its ranks load in worker processes
    (3, _config("meta"), 3),  # not a CPU model
])
def test_one_thread_fewer_while_building(threads, start, config, inside):
    torch.set_num_threads(start)
    with one_cpu_left_to_the_front(config):
        assert torch.get_num_threads() == inside
    assert torch.get_num_threads() == start


def test_restored_after_a_failed_build_but_not_over_a_chosen_count(threads):
    torch.set_num_threads(3)
    with pytest.raises(RuntimeError), one_cpu_left_to_the_front(_config()):
        raise RuntimeError("the build failed")
    assert torch.get_num_threads() == 3
    with one_cpu_left_to_the_front(_config()):
        torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
