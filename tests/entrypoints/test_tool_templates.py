"""Tool-aware chat templates (issue 44, item 2). pagedllm ships one for each family it serves:
Gemma 3, Llama 3.x, Qwen 2.5/3, Mistral, Phi-3 and Granite (FAMILIES below). For each, a request's
tools, its assistant tool_calls and its tool results all reach the prompt, and the calls are written
in the markup the family's --tool-call-parser reads back. A shipped template is used only when the
model's own template has no tool support and the request uses tools; --chat-template wins; the
switch is logged once."""

from __future__ import annotations

import json
import logging

import pytest

from pagedllm.entrypoints import tool_templates
from pagedllm.entrypoints.chat_utils import load_shipped_template, render_conversations
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.entrypoints.tool_templates import TOOL_TEMPLATES, supports_tools, tool_template_of

# family -> the --tool-call-parser its shipped template writes calls for
FAMILIES = {"gemma3": "hermes", "llama3": "llama3_json", "qwen": "hermes", "mistral": "mistral",
            "phi3": "hermes", "granite": "hermes"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a zone",
                                      "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
USER = {"role": "user", "content": "Weather and time in Paris?"}
ASSISTANT = {"role": "assistant", "content": None, "tool_calls": [
    {"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
    for i, (n, a) in enumerate(CALLS)]}
RESULTS = [{"role": "tool", "tool_call_id": "call0abcd", "content": "21 degrees and sunny"},
           {"role": "tool", "tool_call_id": "call1abcd", "content": "10:42"}]
CONV = [{"role": "system", "content": "Be brief."}, USER, ASSISTANT, *RESULTS]
# A model's own template that knows nothing of tools (as Llama 3.0's or Phi-3's); Gemma's GGUF has none at all.
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _tokenizer(markers: tuple[str, ...], chat_template: str | None = None):
    """A word-level tokenizer whose vocabulary holds a family's turn markers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    tok.chat_template = chat_template
    return tok


def _entry(family: str):
    return next(e for e in TOOL_TEMPLATES if e.family == family)


def _family_tokenizer(family: str):
    """The family's vocabulary with a template that ignores tools (Gemma: none, so gemma.jinja)."""
    return _tokenizer(_entry(family).markers, None if family == "gemma3" else PLAIN)


def test_the_families_with_tool_templates():
    assert {e.family: e.parser for e in TOOL_TEMPLATES} == FAMILIES
    for entry in TOOL_TEMPLATES:
        assert entry.parser in ToolParserManager.list()
        assert supports_tools(tool_templates.load_tool_template(entry.file))


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_calls_and_results_reach_the_prompt(family):
    entry = _entry(family)
    tok = _family_tokenizer(family)
    assert tool_template_of(tok) == entry
    (text,) = render_conversations(tok, CONV, chat_template_kwargs={"tools": TOOLS})
    for tool in TOOLS:
        assert tool["function"]["name"] in text and tool["function"]["description"] in text
    for name, args in CALLS:
        assert name in text and json.dumps(args)[1:-1] in text
    for result in RESULTS:
        assert result["content"] in text
    assert "Be brief." in text and USER["content"] in text


@pytest.mark.parametrize("family", FAMILIES)
def test_calls_are_written_in_the_markup_their_parser_reads(family):
    """The assistant turn the template writes, fed to the family's parser, gives back the same calls."""
    entry = _entry(family)
    tok = _family_tokenizer(family)
    kwargs = {"chat_template_kwargs": {"tools": TOOLS}}
    (head,) = render_conversations(tok, [USER], **kwargs)
    (whole,) = render_conversations(tok, [USER, ASSISTANT], add_generation_prompt=False, **kwargs)
    assert whole.startswith(head)
    parsed = ToolParserManager.get(entry.parser)(tok).extract_tool_calls(whole[len(head):])
    assert parsed.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == CALLS


@pytest.mark.parametrize("family", FAMILIES)
def test_a_history_with_results_renders_without_tools_too(family):
    """A follow-up that leaves `tools` out still shows its calls and results."""
    tok = _family_tokenizer(family)
    (text,) = render_conversations(tok, [USER, ASSISTANT, *RESULTS, {"role": "user", "content": "Thanks"}])
    assert all(n in text for n, _ in CALLS) and all(r["content"] in text for r in RESULTS)


def test_which_template_renders():
    gemma = _entry("gemma3")
    tok = _tokenizer(gemma.markers)
    plain = load_shipped_template("gemma")
    (no_tools,) = render_conversations(tok, [USER])
    assert no_tools == render_conversations(tok, [USER], chat_template=plain)[0]  # no tools: the plain template
    (with_tools,) = render_conversations(tok, [USER], chat_template_kwargs={"tools": TOOLS})
    assert "get_weather" in with_tools and "<tool_call>" in with_tools
    # --chat-template (or a request's template) wins, tools or not
    (chosen,) = render_conversations(tok, [USER], chat_template=plain, chat_template_kwargs={"tools": TOOLS})
    assert chosen == no_tools
    # a model whose own template reads tools keeps it
    own = "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}{{ m.tool_calls }}" \
          "{{ m.content }}{% endfor %}"
    tok_own = _tokenizer(gemma.markers, chat_template=own)
    assert render_conversations(tok_own, [USER], chat_template_kwargs={"tools": TOOLS}) == \
        [f"get_weather get_time {USER['content']}"]
    # a model of another family, whose own template ignores tools: rendered as is, with a warning
    tok_other = _tokenizer((), chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert render_conversations(tok_other, [USER], chat_template_kwargs={"tools": TOOLS}) == [USER["content"]]


def test_the_switch_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(tool_templates, "_logged", set())
    tok = _family_tokenizer("llama3")
    with caplog.at_level(logging.INFO, logger="pagedllm.entrypoints.tool_templates"):
        for _ in range(3):
            render_conversations(tok, [USER], chat_template_kwargs={"tools": TOOLS})
    lines = [r.getMessage() for r in caplog.records if "tool template" in r.getMessage()]
    assert len(lines) == 1 and "llama3" in lines[0] and "--chat-template" in lines[0]


def test_supports_tools_reads_code_not_comments():
    assert not supports_tools(load_shipped_template("gemma"))
    assert not supports_tools("{# tools and tool_calls are ignored #}{{ messages }}")
    assert supports_tools("{% if tools %}{{ tools }}{% endif %}{{ messages[0].tool_calls }}")
