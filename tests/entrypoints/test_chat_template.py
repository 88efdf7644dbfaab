"""The bounded chat-template renderer: the same text as transformers' apply_chat_template on
real templates, and a clear ChatTemplateError (never a hang, a huge allocation or a sandbox
escape) for hostile ones."""

from __future__ import annotations

import threading
import time

import pytest

from pagedllm.entrypoints.chat_template import ChatTemplateError, render_template
from pagedllm.entrypoints.chat_utils import load_shipped_template, render_conversations

MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? "},
    {"role": "assistant", "content": "4", "reasoning_content": "adding"},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if tools %}Tools: {% for t in tools %}{{ t | tojson(indent=2) }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_LIKE = (
    "{%- set ns = namespace(sys=false) %}{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- set ns.sys = true %}{%- endif %}"
    "{%- if message.reasoning_content is defined and message.role == 'assistant' %}"
    "<|im_start|>{{ message.role }}\n<think>{{ message.reasoning_content }}</think>{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- if loop.last and ns.sys %}{# seen #}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{% generation %}{% endgeneration %}{{ strftime_now('%Y') | length }}"
)


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("template", [LLAMA3_LIKE, QWEN_LIKE, "gemma"], ids=["llama3", "qwen", "gemma"])
@pytest.mark.parametrize("mode", ["generation_prompt", "continue_final", "tools"])
def test_same_text_as_transformers(tok, template, mode):
    source = load_shipped_template("gemma") if template == "gemma" else template
    msgs = [dict(m) for m in MSGS]
    kwargs = {"add_generation_prompt": mode != "continue_final", "continue_final_message": mode == "continue_final"}
    if mode == "continue_final":
        msgs.append({"role": "assistant", "content": "It is sunny "})
    extra = {"tools": TOOLS} if mode == "tools" else {}
    want = tok.apply_chat_template(msgs, tokenize=False, chat_template=source, **kwargs, **extra)
    (got,) = render_conversations(tok, msgs, chat_template=source, chat_template_kwargs=extra, **kwargs)
    assert got == want


@pytest.mark.parametrize("source, match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "too long"),
    ("{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}", "too long"),
    ("{% for m in messages %}{% for a in messages %}{% for b in messages %}{% for c in messages %}"
     "{% for d in messages %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}", "too long"),
    ('{{ "a" * 10000000000 }}', "repeated value"),
    ('{{ "a" | center(1000000000) }}', "number too large"),
    ('{{ "%999999999d" % 1 }}', "width too large"),
    ('{{ "{:999999999}".format(1) }}', "width too large"),
    ("{{ 10 ** 100000000 }}", "power too large"),
    ('{% set ns = namespace(x="ab") %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}{% endfor %}',
     "concatenation"),
    ('{% for i in range(100000) %}{{ "x" * 1000 }}{% endfor %}', "larger than"),
    ("{{ range(10000000) | list }}", "range|too large"),
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{{ raise_exception('no system messages') }}", "no system messages"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", "underscore"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ unclosed }", "does not compile"),
    ('{% set ns = namespace(x="ab") %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}',
     r"concatenation \(~\) larger than 1000000"),
    ('{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}',
     "number too large"),
] + [(f'{{% set s = "a" * 100000 %}}{expr}', match) for expr, match in [
    ("{{ ([s] * 64) | join }}", "join larger"),
    ("{{ ''.join([s] * 64) }}", "join larger"),
    ("{{ ([s] * 64) | map('upper') | join('-') }}", "join larger"),
    ("{{ s.replace('a', 'b' * 64) }}", "replacement larger"),
    ("{{ s | replace('a', 'b' * 64) }}", "replacement larger"),
    ("{{ [s] * 64 }}", "output value larger"),
    ("{{ {'k': [s] * 64} }}", "output value larger"),
    ("{{ ([s] * 64) | tojson }}", "tojson result larger"),
    ("{{ ([s] * 64) | string }}", "string result larger"),
    ("{{ ('{0}' * 64).format(s) }}", "formatted string larger"),
    ("{{ ('%s' * 64) % ((s,) * 64) }}", "formatted string larger"),
    ("{{ ('%s' * 64) | format(*([s] * 64)) }}", "formatted string larger"),
    ("{{ ('x' ~ '\n' * 100000) | indent(64) }}", "indented string larger"),
    ("{{ ('\t' * 100000).expandtabs(64) }}", "expanded string larger"),
]])
def test_hostile_templates_fail_fast_and_clearly(source, match):
    """The slow templates hit a 0.5 s budget; the others get a wider one, so a loaded host still shows their own
    error (a deep recursion under the tracer can take over 0.5 s when the suite's other worker holds the cores)."""
    msgs = [{"role": "user", "content": "hi"}] * 40
    timeout_s = 0.5 if match == "too long" else 5.0
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=match):
        render_template(source, msgs, add_generation_prompt=True, timeout_s=timeout_s, max_chars=1_000_000)
    assert time.monotonic() - start < timeout_s + 5


def test_limits_do_not_leak_to_other_threads_or_tracers():
    """The tracer is the render's own and is removed after it; another thread's render has its own budget."""
    import sys

    before = sys.gettrace()
    errors = []

    def slow():
        try:
            render_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            [{"role": "user", "content": "x"}], add_generation_prompt=True, timeout_s=0.3)
        except ChatTemplateError as e:
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    out = render_template("{{ messages[0].content }}", [{"role": "user", "content": "ok"}], add_generation_prompt=False)
    t.join()
    assert out == "ok" and len(errors) == 1 and sys.gettrace() is before


def test_request_style_template_is_never_a_path(tok, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the key")
    with pytest.raises(ValueError, match="Jinja template text"):
        render_conversations(tok, [{"role": "user", "content": "hi"}], chat_template=str(secret),
                             template_is_text=True)
    # the operator's / offline form still reads a file
    (got,) = render_conversations(tok, [{"role": "user", "content": "hi"}], chat_template=str(secret))
    assert got == "the key"


@pytest.mark.parametrize("kwargs, match", [
    ("not a dict", "must be an object"),
    ({1: "x"}, "keys must be strings"),
])
def test_chat_template_kwargs_of_the_wrong_type(tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_conversations(tok, [{"role": "user", "content": "hi"}], chat_template=LLAMA3_LIKE,
                             chat_template_kwargs=kwargs)


def test_lone_surrogate_in_a_message_is_a_value_error(tok):
    with pytest.raises(ValueError, match="lone surrogate"):
        render_conversations(tok, [{"role": "user", "content": "hi \ud800"}], chat_template=LLAMA3_LIKE)


def test_size_checks_refuse_before_building():
    """The would-be size is refused, not the built one: no 256 MB string on the way to the error."""
    import tracemalloc

    source = '{% set s = "a" * 4000000 %}{{ ([s] * 64) | join }}{{ s.replace("a", "b" * 64) }}'
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match="larger than 16777216"):
            render_template(source, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024


def test_checked_operations_still_work():
    source = ("{{ messages | map(attribute='content') | join(', ') }}|{{ 'a' ~ 1 ~ none }}|"
              "{{ 'xy'.replace('x', 'z') }}|"
              "{{ '%s-%d' % ('a', 2) }}|{{ '{0}!'.format('b') }}|{{ 'p\nq' | indent(2) }}|{{ [1, 'b'] }}|"
              "{{ ['c', 'd'] | tojson }}|{{ '%s' | format('e') }}")
    out = render_template(source, MSGS[:2], add_generation_prompt=True)
    assert out == 'Be brief., What is 2+2? |a1None|zy|a-2|b!|p\n  q|[1, \'b\']|["c", "d"]|e'


def test_template_source_is_capped_and_compiled_within_the_time_limit(tok):
    from pagedllm.entrypoints.chat_template import MAX_TEMPLATE_CHARS

    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=f"more than the limit of {MAX_TEMPLATE_CHARS}"):
        render_conversations(tok, msgs, chat_template="{{ 1 }}" + " " * MAX_TEMPLATE_CHARS, template_is_text=True)
    big = "{{ messages[0].content }}" * (MAX_TEMPLATE_CHARS // 25)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="too long to compile"):
        render_template(big, msgs, add_generation_prompt=True, timeout_s=0.05)
    assert time.monotonic() - start < 1
    # an operator's template (a file or the model's own) is trusted with any length
    (got,) = render_conversations(tok, msgs, chat_template="{{ 'x' }}" + " " * MAX_TEMPLATE_CHARS)
    assert got.startswith("x")


def test_a_compile_past_the_deadline_fails_even_if_the_tracer_was_lost(monkeypatch):
    """Python unsets a trace function whose error something swallowed (a generator the garbage
    collector closes mid-compile): the compile then runs to its end, and its lateness still fails
    the render as a compile timeout."""
    from pagedllm.entrypoints import chat_template

    monkeypatch.setattr(chat_template, "compile_tracer", lambda budget: None)
    big = "{{ messages[0].role }}" * (chat_template.MAX_TEMPLATE_CHARS // 22)
    with pytest.raises(ChatTemplateError, match="too long to compile"):
        render_template(big, [{"role": "user", "content": "hi"}], add_generation_prompt=True, timeout_s=0.05)
