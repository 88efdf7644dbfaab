"""Tool-call parsers on canned model outputs, whole and streamed (per char, in random chunks, per token of a
real tokenizer): the streamed calls must rebuild exactly the non-streaming ones, and markup never shows up
as content."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from tests.utils import chunkings as _chunkings

W = {"city": "Paris", "unit": "celsius"}
RICH = {"q": 'café 日本語 🎉 "quoted" \\ back', "opts": {"n": [1, 2.5, -300.0], "x": None, "y": True}, "e": {}}
RICH_JSON = json.dumps(RICH, ensure_ascii=False)

# parser -> [(model output, expected content, expected [(name, arguments)])]
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict]]]]] = {
    "hermes": [
        (f"I'll check.\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {json.dumps(W)}}}\n</tool_call>",
         "I'll check.", [("get_weather", W)]),
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", '
         f'"arguments": {RICH_JSON}}}\n</tool_call>', None, [("a", {"x": 1}), ("b", RICH)]),
        ('<tool_call>{ "arguments" : {"k": [1, {"z": "}"}]} , "name" : "late_name" }</tool_call>', None,
         [("late_name", {"k": [1, {"z": "}"}]})]),
        ('<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("s", {"a": 1})]),
        ('Two:\n<tool_call>{"name": "noargs"}</tool_call>\n\n<tool_call>{"name": "n", "arguments": null}'
         '</tool_call>\nDone.', "Two:\n\n\n\nDone.", [("noargs", {}), ("n", {})]),
        ('<tool_call>\n{"name": "unclosed", "arguments": {"a": "b"}}\n', None, [("unclosed", {"a": "b"})]),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}', None, [("get_weather", W)]),
        (f'<|python_tag|>{{"name": "a", "arguments": {RICH_JSON}}}; {{"name": "b", "parameters": {{}}}}', None,
         [("a", RICH), ("b", {})]),
        ('Let me look that up. <|python_tag|>{"type": "function", "name": "f", "parameters": {"n": -1.5e3}}',
         "Let me look that up.", [("f", {"n": -1500.0})]),
        ('\n{"name": "f", "parameters": {"a": 1}};\n{"name": "g", "parameters": {"b": [true, false]}}', None,
         [("f", {"a": 1}), ("g", {"b": [True, False]})]),
    ],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(W)}}}]', None, [("get_weather", W)]),
        (f'Sure thing. [TOOL_CALLS][{{"name": "a", "arguments": {RICH_JSON}}}, {{"name": "b", "arguments": {{}}}}]',
         "Sure thing.", [("a", RICH), ("b", {})]),
        ('[TOOL_CALLS]\n[\n  {"arguments": {"x": "y"}, "name": "c"}\n]', None, [("c", {"x": "y"})]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius")]', None, [("get_weather", W)]),
        ("[get_weather(city='Paris'), get_time()]", None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ('[\n  f(a=1, b=-2.5, c=True, d=None, e=[1, "x,)"], f={"k": (1, 2)}, g="""tri""", h=\'日本 🎉\',),\n]',
         None, [("f", {"a": 1, "b": -2.5, "c": True, "d": None, "e": [1, "x,)"], "f": {"k": [1, 2]},
                       "g": "tri", "h": "日本 🎉"})]),
        ("<|python_start|>[g( x = 'a\\'b' )]<|python_end|>", None, [("g", {"x": "a'b"})]),
    ],
}
PLAIN = ["Hello! No tools needed here.\n", "  Leading spaces and a trailing newline\n\n", "Use <tool> or [TOOL] tags",
         "", '{"answer": 42}', "[1, 2, 3]", "[Note] read this", "[]", "x < y and a[0]"]
INVALID = {
    "hermes": ['<tool_call>{"name": "f", "arguments": {\'a\': 1}}</tool_call>', "<tool_call>not json</tool_call> ok",
               '<tool_call>{"name": "f", "argu', '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
               '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
               '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>'],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}; {"name"', '{"name": "f", "parameters": {"a": NaN}}',
                    '<|python_tag|>{"name": "f", "parameters": {}}; {"oops": 1}'],
    "mistral": ["[TOOL_CALLS] not json", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}]', "[TOOL_CALLS]"],
    "pythonic": ["[f(1)]", '[f(a=__import__("os").system("x"))]', "[f(a=1)", "[f(a=1, a=2)]", "[f(a={1, 2})]",
                 "[f(a=1), 3]", "[f(**kw)]"],
}
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|python_start|>")


def chunkings(text: str, tok) -> dict[str, list[str]]:
    return _chunkings(text, tok, seeds=3, max_chunk=9)


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed deltas as serving does and rebuild content and calls, checking the delta protocol on the way."""
    content, calls, prev = "", [], ""

    def take(d) -> None:
        nonlocal content
        if d is None:
            return
        content += d.content or ""
        for t in d.tool_calls:
            if t.index == len(calls):  # a new call: announced with id, type and name
                assert t.id and t.type == "function" and t.function.name and t.function.arguments is not None
                calls.append({"id": t.id, "name": t.function.name, "arguments": t.function.arguments, "n": 1})
            else:
                assert t.index < len(calls) and t.id is None and t.type is None and t.function.name is None
                calls[t.index]["arguments"] += t.function.arguments
                calls[t.index]["n"] += 1

    for piece in pieces:
        cur = prev + piece
        take(parser.extract_tool_calls_streaming(prev, cur, piece))
        prev = cur
    take(parser.finish_streaming(prev))
    return content, calls


@pytest.mark.parametrize("name,case", [(n, i) for n, cases in CASES.items() for i in range(len(cases))])
def test_calls_whole_and_streamed(name, case, fake_tokenizer):
    output, want_content, want_calls = CASES[name][case]
    cls = ToolParserManager.get(name)
    res = cls(fake_tokenizer).extract_tool_calls(output, tools=None)
    assert res.tools_called and res.content == want_content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in res.tool_calls] == want_calls
    assert all(c.type == "function" for c in res.tool_calls)
    assert len({c.id for c in res.tool_calls}) == len(want_calls)
    for how, pieces in chunkings(output, fake_tokenizer).items():
        parser = cls(fake_tokenizer)
        content, calls = stream(parser, pieces)
        assert content == (res.content or ""), how
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in res.tool_calls], how
        assert len({c["id"] for c in calls}) == len(calls)
        assert [c.id for c in parser.streamed_tool_calls] == [c["id"] for c in calls]
        assert not any(m in content for m in MARKUP)
        if how == "chars" and name != "pythonic":  # raw JSON arguments after the name arrive in pieces
            assert all(c["n"] > 2 for c in calls if len(c["arguments"]) > 4 and c["arguments"] in output
                       and output.find(c["name"]) < output.find(c["arguments"]))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_is_content_exactly(name, text, fake_tokenizer):
    cls = ToolParserManager.get(name)
    res = cls(fake_tokenizer).extract_tool_calls(text, tools=None)
    assert not res.tools_called and res.tool_calls == [] and res.content == text
    for how, pieces in chunkings(text, fake_tokenizer).items():
        assert stream(cls(fake_tokenizer), pieces) == (text, []), how


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in INVALID.items() for t in texts])
def test_invalid_markup_is_plain_content_and_never_raises(name, text, fake_tokenizer):
    cls = ToolParserManager.get(name)
    res = cls(fake_tokenizer).extract_tool_calls(text, tools=None)
    assert not res.tools_called and res.tool_calls == [] and res.content == text
    for how, pieces in chunkings(text, fake_tokenizer).items():
        content, calls = stream(cls(fake_tokenizer), pieces)  # may have announced a call; must not raise
        assert not any(m in content for m in MARKUP), how


def test_valid_call_after_invalid_one_still_streams(fake_tokenizer):
    text = "<tool_call>oops</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {\"a\": 1}}</tool_call>"
    content, calls = stream(ToolParserManager.get("hermes")(), list(text))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("g", '{"a": 1}')]


def test_tag_split_across_deltas_never_leaks():
    parser = ToolParserManager.get("hermes")()
    d = parser.extract_tool_calls_streaming("", "Hi <tool_", "Hi <tool_")
    assert d.content == "Hi" and not d.tool_calls
    assert parser.extract_tool_calls_streaming("Hi <tool_", "Hi <tool_call>{\"na", "call>{\"na") is None
    d = parser.extract_tool_calls_streaming("", 'Hi <tool_call>{"name": "f", "arguments": {"a"', 'me": "f", ...')
    assert d.content is None and d.tool_calls[0].function.name == "f" and d.tool_calls[0].function.arguments == '{"a"'


def test_mistral_ids_and_special_tokens():
    cls = ToolParserManager.get("mistral")
    res = cls().extract_tool_calls('[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')
    assert all(len(c.id) == 9 and c.id.isalnum() for c in res.tool_calls)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert req.skip_special_tokens and not cls().adjust_request(req).skip_special_tokens


def test_registry():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(ToolParserManager.list())
    assert issubclass(ToolParserManager.get("hermes"), ToolParser)
    with pytest.raises(ValueError, match="hermes"):
        ToolParserManager.get("nope")

    @ToolParserManager.register("test_dummy")
    class Dummy(ToolParser):
        def parse(self, text, final):
            raise RuntimeError("broken parser")

    assert ToolParserManager.get("test_dummy") is Dummy
    assert Dummy().extract_tool_calls("x").content == "x"  # a buggy parser degrades to plain content
    assert Dummy().extract_tool_calls_streaming("", "x", "x") is None
    ToolParserManager._entries.pop("test_dummy")


@pytest.mark.parametrize("name,prefix", [("hermes", '<tool_call>{"name": "f", "arguments": {"q": "'),
                                         ("pythonic", "[f(q='")])
def test_long_unfinished_string_scans_in_linear_time(name, prefix):
    """Streaming rescans the open call on every delta; an unclosed string must not make a regex backtrack
    exponentially (this hung before the string patterns were unrolled)."""
    parser = ToolParserManager.get(name)()
    text = prefix + "word, (x) " * 20000
    d = parser.extract_tool_calls_streaming("", text, text)
    assert d.tool_calls[0].function.name == "f"
    assert parser.extract_tool_calls(text + ("\"}}</tool_call>" if name == "hermes" else "')]")).tools_called
