"""One slow grammar must not jam the others (compile_pool.py): a small schema is answered in
under 2 s while a large one compiles; a compile whose requests are gone is dropped (queued) or
its process killed (running); a compile past its time limit fails its request with a clear
error; requests with the same spec share one compile."""

from __future__ import annotations

import json
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import limits
from pagedllm.structured_output.grammar import recipe
from tests.structured_output.conftest import PROMPTS
from tests.utils import assert_idle

pytestmark = pytest.mark.usefixtures("one_thread")


def big(tag: str, n: int = 300) -> StructuredOutputsParams:
    """A grammar well inside the size limits that takes ~13 s to compile on a fast host even for
    the tiny 384-token vocabulary (3.4 s at 150, 25 s at 400): a sequence of `n` bounded
    repetitions, each bound distinct. xgrammar unrolls each one, and the cost grows with the
    square of `n`."""
    assert n * 20 < limits.MAX_GRAMMAR_CHARS
    rules = " ".join(f'[a-z]{{0,{100 + i}}} "-"' for i in range(n))
    return StructuredOutputsParams(grammar=f'root ::= "{tag}" {rules}')


def small(tag: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object", "properties": {tag: {"enum": [1, 2, 3]}},
                                         "required": [tag], "additionalProperties": False})


def wait_for(condition, timeout: float = 30.0, step=None) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        if step is not None:
            step()
        else:
            time.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
def pool(llama):
    """The engine's compiler pool, started and warm (its processes imported xgrammar)."""
    so = StructuredOutputsParams(choice=["warm", "up"])
    llama.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    pool = llama.llm_engine.engine_core.structured_output_manager._compiler.pool
    wait_for(lambda: all(w is not None and w.ready for w in pool._workers), timeout=120)
    return pool


def running(pool, label: str = "structured_outputs.grammar") -> list:
    return [w for w in pool._workers if w is not None and w.job is not None and w.job.label == label]


def test_small_schema_answered_while_a_large_one_compiles(llama, pool):
    engine = llama.llm_engine
    engine.add_request("big", PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=big("jam")))
    wait_for(lambda: running(pool))
    busy = running(pool)[0]
    start = time.monotonic()
    engine.add_request("small", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                           structured_outputs=small("jam_small")))
    done: dict = {}

    def step() -> None:
        done.update({o.request_id: o for o in engine.step() if o.finished})

    wait_for(lambda: "small" in done, step=step)
    latency = time.monotonic() - start
    assert latency < 2.0, latency
    assert json.loads(done["small"].outputs[0].text)["jam_small"] in (1, 2, 3)
    assert busy.job is not None and "big" not in done  # the large one was compiling all along
    engine.abort_request("big")
    wait_for(lambda: busy.proc.poll() is not None, timeout=5)  # its compile was killed with it
    assert_idle(llama)


def test_an_aborted_requests_compile_is_dropped(llama, pool):
    """Two compiles running, one queued; all three requests aborted: both processes are killed,
    the queue is empty, and a new request is served by the replacements."""
    engine = llama.llm_engine
    for i in range(3):
        engine.add_request(f"big{i}", PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=big(f"drop{i}")))
    wait_for(lambda: len(running(pool)) == 2 and len(pool._queue) == 1)
    busy = running(pool)
    engine.abort_request(["big0", "big1", "big2"])
    wait_for(lambda: all(w.proc.poll() is not None for w in busy), timeout=5)
    assert not pool._queue and not pool._inflight
    out = llama.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                    structured_outputs=small("after_drop")), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "stop"
    assert_idle(llama)


def test_a_shared_compile_runs_until_its_last_request_is_gone(llama, pool):
    manager = llama.llm_engine.engine_core.structured_output_manager
    tickets = [manager._compiler.compile(big("shared")) for _ in range(3)]
    assert len({id(t._job) for t in tickets}) == 1
    wait_for(lambda: running(pool))
    busy = running(pool)[0]
    for t in tickets[:2]:
        t.release()
    time.sleep(0.3)
    assert busy.proc.poll() is None and busy.job is tickets[2]._job
    tickets[2].release()
    wait_for(lambda: busy.proc.poll() is not None, timeout=5)


def test_compile_past_the_time_limit_fails_its_request(llama, pool, monkeypatch):
    monkeypatch.setattr(pool, "timeout_s", 1.0)
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    start = time.monotonic()
    outs = llama.generate(PROMPTS, [good, SamplingParams(max_tokens=8, structured_outputs=big("slow"))],
                          use_tqdm=False)
    assert time.monotonic() - start < 15
    assert len(outs[0].outputs[0].token_ids) == 8
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "abort" and failed.token_ids == []
    assert "structured_outputs.grammar did not compile within the limit of 1 s" in str(failed.stop_reason)
    assert_idle(llama)


def test_the_compiled_grammar_is_not_sent_back(llama, pool):
    """A compiler process answers only that its compile succeeded; the engine compiles the
    grammar again itself (xgrammar's JSON of this one is ~15 MB even for the tiny vocabulary),
    and gets the very grammar the process made."""
    import pickle

    import xgrammar as xgr

    sizes: list[int] = []

    def spy(conn) -> None:
        recv = conn.recv

        def counted():
            message = recv()
            sizes.append(len(pickle.dumps(message)))
            return message

        conn.recv = counted

    # An earlier test's overdue compile killed its worker: the slot is empty until its restart.
    wait_for(lambda: all(w is not None and w.ready for w in pool._workers))
    for worker in pool._workers:
        spy(worker.recv)
    props = {f"k{i}": {"type": "string", "maxLength": 60 + i} for i in range(100)}
    params = StructuredOutputsParams(json={"type": "object", "properties": props})
    manager = llama.llm_engine.engine_core.structured_output_manager
    ticket = manager._compiler.compile(params)
    wait_for(ticket.done)
    grammar = ticket.result()
    ticket.release()
    assert sizes and max(sizes) < 1000, sizes
    kind, args, kwargs = recipe(params)
    direct = getattr(xgr.GrammarCompiler(pool.info, cache_enabled=False), f"compile_{kind}")(*args, **kwargs)
    expected = direct.serialize_json()
    assert len(expected) > 10_000_000 and grammar.serialize_json() == expected
