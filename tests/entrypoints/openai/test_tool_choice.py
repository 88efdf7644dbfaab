"""tool_choice without a model: the modes and their 400s, the grammars built for `required`,
named and `--tool-choice-auto-grammar` (walked with an xgrammar matcher), and how a choice's
text becomes tool calls, whole and streamed, also when max_tokens cuts it (the cut call is kept,
as the stream sent it)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.chat_tools import (
    AUTO_GRAMMAR_MARKUP,
    AUTO_TOOL_CHOICE_NEEDS_FLAGS,
    MAX_PARALLEL_TOOL_CALLS,
    ChoiceParser,
    tool_constraint,
    tool_mode,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.structured_output.grammar import recipe
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE

MSGS = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
CALLS = [("get_weather", '{"city":"Paris","days":3}'), ("get_time", '{"zone":"UTC"}'),
         ("get_weather", '{"city":"Lima \\"C\\"","days":1}')]
REQUIRED_TEXT = "[" + ",".join(f'{{"name":"{n}","parameters":{a}}}' for n, a in CALLS) + "]"


def _req(**kw):
    return SimpleNamespace(**{"tools": TOOLS, "tool_choice": None, "parallel_tool_calls": None, **kw})


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1)


def _accepts(compiler, so, text: str) -> bool:
    kind, args, kwargs = recipe(so)
    m = xgr.GrammarMatcher(getattr(compiler, f"compile_{kind}")(*args, **kwargs))
    return m.accept_string(text) and m.is_completed()


# ---- modes ---------------------------------------------------------------------------------------------------

def test_tools_without_tool_choice_mean_auto():
    assert tool_mode(_req(), auto_enabled=True) == ("auto", None)
    assert tool_mode(_req(tools=None), auto_enabled=False) == (None, None)
    assert tool_mode(_req(tools=[]), auto_enabled=False) == (None, None)
    assert tool_mode(_req(tool_choice="none"), auto_enabled=False) == (None, None)
    for choice in (None, "auto"):  # implicit and explicit "auto": the same 400, naming the flags
        with pytest.raises(OpenAIError) as e:
            tool_mode(_req(tool_choice=choice), auto_enabled=False)
        assert e.value.message == AUTO_TOOL_CHOICE_NEEDS_FLAGS and e.value.param == "tool_choice"


@pytest.mark.parametrize("kw, needle", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tool_choice="required", tools=None), "needs `tools`"),
    (dict(tool_choice="sometimes"), "tool_choice must be"),
    (dict(tool_choice="required", tools=[{"type": "function", "function": {}}]), "each tool must be"),
    (dict(tool_choice="required", tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}]),
     "must be a JSON schema object"),
])
def test_misuse_is_400(kw, needle):
    with pytest.raises(OpenAIError) as e:
        tool_mode(_req(**kw), auto_enabled=True)
        tool_constraint(_req(**kw), "required", None)
    assert e.value.status == 400 and needle in e.value.message


# ---- grammars ------------------------------------------------------------------------------------------------

def test_required_grammar_allows_one_call_or_a_bounded_number(compiler):
    one = '[{"name":"get_time","parameters":{"zone":"CET"}}]'
    single = tool_constraint(_req(parallel_tool_calls=False), "required", None)
    assert _accepts(compiler, single, one)
    assert not _accepts(compiler, single, REQUIRED_TEXT)
    assert not _accepts(compiler, single, "[]")
    many = tool_constraint(_req(), "required", None)
    assert many.json["maxItems"] == MAX_PARALLEL_TOOL_CALLS
    calls = ",".join([one[1:-1]] * MAX_PARALLEL_TOOL_CALLS)
    assert _accepts(compiler, many, REQUIRED_TEXT) and _accepts(compiler, many, f"[{calls}]")
    assert not _accepts(compiler, many, f"[{calls},{one[1:-1]}]")
    three = tool_constraint(_req(parallel_tool_calls=True), "required", None, max_calls=3)
    assert _accepts(compiler, three, REQUIRED_TEXT)
    assert not _accepts(compiler, three, f"[{calls}]")
    # the tools' schemas hold: an unknown name or a bad argument is refused
    assert not _accepts(compiler, many, '[{"name":"get_date","parameters":{"zone":"UTC"}}]')
    assert not _accepts(compiler, many, '[{"name":"get_weather","parameters":{"city":"Paris","days":9}}]')


def test_named_grammar_is_the_tools_schema(compiler):
    so = tool_constraint(_req(), "named", "get_weather")
    assert _accepts(compiler, so, '{"city":"Rome","days":2}')
    assert not _accepts(compiler, so, '{"zone":"UTC"}')


@pytest.mark.parametrize("parser", sorted(AUTO_GRAMMAR_MARKUP))
def test_auto_grammar_allows_text_or_one_call_the_parser_reads(compiler, parser):
    so = tool_constraint(_req(), "auto", None, auto_grammar=parser)
    _, begin, end = AUTO_GRAMMAR_MARKUP[parser]
    call = begin.format(name='"get_weather"') + '{"city": "Oslo", "days": 2}' + end
    assert _accepts(compiler, so, "Just text, no call.")
    assert _accepts(compiler, so, "")
    assert _accepts(compiler, so, call)
    assert _accepts(compiler, so, "Let me check. " + call)
    assert not _accepts(compiler, so, call + " and more text")  # one call, then the end
    assert not _accepts(compiler, so, begin.format(name='"get_weather"') + '{"city": "Oslo", "days": 70}' + end)
    assert not _accepts(compiler, so, begin.format(name='"rm_rf"') + "{}" + end)
    extracted = ToolParserManager.get(parser)(None).extract_tool_calls("Let me check. " + call)
    assert extracted.tools_called
    [tc] = extracted.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Oslo", "days": 2}


# ---- parsing whole and streamed ------------------------------------------------------------------------------

def _stream(parser: ChoiceParser, text: str, step: int, finished_at: int | None = None) -> tuple[list, list]:
    """Feed `text` in pieces of `step` characters; returns (raw delta tool calls, calls by index)."""
    raw, calls = [], {}
    end = len(text) if finished_at is None else finished_at
    for i in range(0, end, step):
        j = min(i + step, end)
        d = parser.delta(text[:i], text[:j], finished=j == end)
        if d is None:
            continue
        assert d.content is None
        for t in d.tool_calls or []:
            raw.append(t)
            entry = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id is not None:
                assert entry["id"] is None and t.type == "function" and t.function.name
                assert t.function.arguments == "", "the first delta of a call has arguments ''"
                entry["id"], entry["name"] = t.id, t.function.name
            else:
                assert entry["id"] is not None and t.function.name is None
                entry["arguments"] += t.function.arguments
    return raw, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 17, 1000])
def test_required_streams_arguments_and_equals_the_whole(step):
    _, whole, calls = ChoiceParser("required", None, None, None).final(REQUIRED_TEXT)
    assert whole is None and [(c.function.name, c.function.arguments) for c in calls] == CALLS
    raw, streamed = _stream(ChoiceParser("required", None, None, None), REQUIRED_TEXT, step)
    assert [(c["name"], c["arguments"]) for c in streamed] == CALLS
    if step == 1:  # arguments arrive as they are generated, not one delta per call
        assert sum(1 for t in raw if t.id is None) > sum(len(a) for _, a in CALLS) // 2


def _calls(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


def test_required_cut_by_max_tokens_keeps_what_the_stream_sent():
    """Cut by max_tokens (truncated), the body holds the calls the stream sent, the unfinished one
    as far as it got (as OpenAI's API does); an output that merely ends early keeps the complete ones."""
    for cut in range(len(REQUIRED_TEXT)):
        text = REQUIRED_TEXT[:cut]
        _, content, calls = ChoiceParser("required", None, None, None).final(text)
        assert content is None
        done = [(n, a) for n, a in CALLS if f'"parameters":{a}}}' in text]
        assert _calls(calls) == done, text
        _, streamed = _stream(ChoiceParser("required", None, None, None), text, 5) if text else (None, [])
        streamed = [(c["name"], c["arguments"]) for c in streamed]
        assert streamed[: len(done)] == done and len(streamed) - len(done) in (0, 1)
        _, content, cut_calls = ChoiceParser("required", None, None, None).final(text, truncated=True)
        assert content is None and _calls(cut_calls) == streamed, text
        assert all(c.id for c in cut_calls)


def test_named_whole_streamed_and_cut():
    args = '{"city":"Paris","days":3}'
    _, content, [call] = ChoiceParser("named", "get_weather", None, None).final(args)
    assert content is None and call.function.name == "get_weather" and call.function.arguments == args
    _, [streamed] = _stream(ChoiceParser("named", "get_weather", None, None), args, 4)
    assert streamed["name"] == "get_weather" and streamed["arguments"] == args
    assert ChoiceParser("named", "get_weather", None, None).final(args[:-3]) == (None, None, [])
    _, content, calls = ChoiceParser("named", "get_weather", None, None).final(args[:-3], truncated=True)
    assert content is None and _calls(calls) == [("get_weather", args[:-3])]


def test_auto_cut_by_max_tokens_keeps_the_unfinished_call():
    hermes = ToolParserManager.get("hermes")
    text = 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"zone": "U'
    assert ChoiceParser("auto", None, hermes(None), None).final(text) == (None, text, [])
    _, content, calls = ChoiceParser("auto", None, hermes(None), None).final(text, truncated=True)
    assert content == "Checking." and _calls(calls) == [("get_time", '{"zone": "U')]
    plain = "Just text, cut"
    assert ChoiceParser("auto", None, hermes(None), None).final(plain, truncated=True) == (None, plain, [])


def test_auto_stream_announces_calls_openai_style():
    hermes = ToolParserManager.get("hermes")
    text = 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    parser = ChoiceParser("auto", None, hermes(None), None)
    first = None
    for i in range(0, len(text), 40):  # coarse pieces: name and arguments arrive in one delta
        d = parser.delta(text[:i], text[:i + 40], finished=i + 40 >= len(text))
        for t in (d.tool_calls or []) if d else []:
            first = first or t
    assert first.id and first.function.name == "get_time" and first.function.arguments == ""


# ---- through the app (scripted engine) -----------------------------------------------------------------------

def _app(fake_engine, **kw):
    base = dict(served_model_names=("fake-model",), chat_template=CHAT_TEMPLATE)
    return TestClient(build_app(fake_engine, ServerConfig(**{**base, **kw})))


def test_implicit_and_explicit_auto_need_the_flag(fake_engine):
    client = _app(fake_engine)
    for extra in ({}, {"tool_choice": "auto"}):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "max_tokens": 2, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == AUTO_TOOL_CHOICE_NEEDS_FLAGS and err["param"] == "tool_choice"
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none",
                                                  "max_tokens": 2})
    assert r.status_code == 200, r.text
    flagged = _app(fake_engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = flagged.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " w0 w1"
    assert fake_engine.calls[-1][1].structured_outputs is None  # plain auto: the model decides freely


def test_flags_shape_the_grammars(fake_engine):
    client = _app(fake_engine, tool_choice_auto_grammar=True, max_parallel_tool_calls=3)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    tag = fake_engine.calls[-1][1].structured_outputs.structural_tag
    assert tag["format"]["triggers"] == ["<tool_call>"] and tag["format"]["stop_after_first"]
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 2, "response_format": {"type": "json_object"}}
    r = client.post("/v1/chat/completions", json=body)  # the request's own constraint wins over the auto grammar
    assert r.status_code == 200 and fake_engine.calls[-1][1].structured_outputs.json_object
    for parallel, most in ((None, 3), (True, 3), (False, 1)):
        body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert fake_engine.calls[-1][1].structured_outputs.json["maxItems"] == most
    with pytest.raises(ValueError, match="--tool-choice-auto-grammar works with"):
        _app(fake_engine, tool_choice_auto_grammar=True, tool_call_parser="pythonic")


def test_response_format_structural_tag_and_options(fake_engine):
    client = _app(fake_engine)
    tag = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}],
           "triggers": ["<a>"]}
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "response_format": tag})
    assert r.status_code == 200, r.text
    assert fake_engine.calls[-1][1].structured_outputs.structural_tag == tag
    body = {"messages": MSGS, "max_tokens": 2, "response_format": {"type": "json_object"},
            "structured_outputs": {"unbounded": True, "disable_any_whitespace": True}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    so = fake_engine.calls[-1][1].structured_outputs
    assert so.json_object and so.unbounded and so.disable_any_whitespace
    for bad, needle in (({"structured_outputs": {"unbounded": True}}, "needs a constraint"),
                        ({"structured_outputs": {"json_object": True, "unbounded": "yes"}}, "true or false"),
                        ({"response_format": {"type": "yaml"}}, "not supported")):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **bad})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
