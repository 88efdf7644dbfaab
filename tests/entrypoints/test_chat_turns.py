"""Repeated roles on strict templates (issue 44, item 1): two user messages in a row, and one tool
message per result of parallel calls, render on templates that demand alternation: tool results
keep the template's own tool turn where it has one, consecutive turns of one role merge. A
template that accepts the conversation as sent renders it unchanged."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.chat_template import ChatTemplateError
from pagedllm.entrypoints.chat_turns import fit_turns, has_tool_turn, render_fitted
from pagedllm.entrypoints.chat_utils import load_shipped_template, render_conversations

CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
PARALLEL = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    {"role": "tool", "tool_call_id": "call_2", "content": "10:00"},
]
TWO_USERS = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Weather in Paris?"}]
# Strict alternation with a tool turn of its own (as Mistral's and Llama 2's older templates check roles).
STRICT_WITH_TOOL_TURN = (
    "{% set ns = namespace(i=0) %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}[RESULT {{ m['tool_call_id'] }}]{{ m['content'] }}[/RESULT]"
    "{% else %}{% if (m['role'] == 'user') != (ns.i % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set ns.i = ns.i + 1 %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}CALL {{ c['function']['name'] }}{% endfor %}{% endif %}"
    "{% endfor %}"
)
LENIENT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
VARS = {"bos_token": "<bos>"}


def _render(source: str, messages: list[dict]) -> str:
    return render_fitted(source, messages, add_generation_prompt=False, variables=VARS)


def test_fit_turns_merges_runs_and_keeps_or_folds_tool_results():
    assert fit_turns(TWO_USERS, tool_turn=True) == [{"role": "user", "content": "Hi\n\nWeather in Paris?"}]
    kept = fit_turns(PARALLEL, tool_turn=True)
    assert kept == PARALLEL and kept[2] is not PARALLEL[2]  # copies: the caller's messages are not changed
    folded = fit_turns(PARALLEL, tool_turn=False)
    assert folded[2:] == [{"role": "user", "content": "21 degrees\n\n10:00"}]
    two_calls = [{"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
                 {"role": "assistant", "content": "and", "tool_calls": CALLS[1:]}]
    assert fit_turns(two_calls, tool_turn=True) == [{"role": "assistant", "content": "and", "tool_calls": CALLS}]


def test_gemma_template_renders_parallel_results_and_repeated_users():
    gemma = load_shipped_template("gemma")
    assert not has_tool_turn(gemma)
    text = _render(gemma, PARALLEL)
    assert text.endswith("<start_of_turn>user\n21 degrees\n\n10:00<end_of_turn>\n")
    assert _render(gemma, TWO_USERS) == "<bos><start_of_turn>user\nHi\n\nWeather in Paris?<end_of_turn>\n"
    system_twice = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}] + TWO_USERS[:1]
    assert _render(gemma, system_twice) == "<bos><start_of_turn>user\nA\n\nB\n\nHi<end_of_turn>\n"


def test_template_with_a_tool_turn_keeps_each_result():
    assert has_tool_turn(STRICT_WITH_TOOL_TURN)
    text = _render(STRICT_WITH_TOOL_TURN, PARALLEL + TWO_USERS)
    assert "[RESULT call_1]21 degrees[/RESULT][RESULT call_2]10:00[/RESULT]" in text
    assert text.endswith("<user>Hi\n\nWeather in Paris?")


def test_an_accepting_template_sees_the_conversation_as_sent():
    assert _render(LENIENT, TWO_USERS) == "<user>Hi<user>Weather in Paris?"
    assert _render(LENIENT, PARALLEL).endswith("<tool>21 degrees<tool>10:00")


def test_what_fitting_cannot_fix_keeps_the_template_error():
    gemma = load_shipped_template("gemma")
    with pytest.raises(ChatTemplateError, match="only as the first"):
        _render(gemma, TWO_USERS + [{"role": "system", "content": "late"}])
    with pytest.raises(ChatTemplateError, match="too long"):  # a limit is not retried
        render_fitted("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      TWO_USERS, add_generation_prompt=False, timeout_s=0.2)


def test_continue_final_message_after_a_merge():
    gemma = load_shipped_template("gemma")
    conv = TWO_USERS + [{"role": "assistant", "content": "It is"}, {"role": "assistant", "content": "sunny"}]
    text = render_fitted(gemma, conv, add_generation_prompt=False, continue_final_message=True, variables=VARS)
    assert text.endswith("<start_of_turn>model\nIt is\n\nsunny")


def test_render_conversations_fits_every_conversation(tmp_path):
    from tests.entrypoints.test_chat import _gemma_like_tokenizer

    tok = _gemma_like_tokenizer(add_bos=False)
    # An explicit template: no tool template takes its place, the fitting still applies.
    out = render_conversations(tok, [PARALLEL, TWO_USERS], chat_template=load_shipped_template("gemma"))
    assert out[0].endswith("21 degrees\n\n10:00<end_of_turn>\n<start_of_turn>model\n")
    assert "Hi\n\nWeather in Paris?" in out[1]
