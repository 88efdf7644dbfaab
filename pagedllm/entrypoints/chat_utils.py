"""Chat conversations → prompts: message validation, template choice (a family's tool template
for a tool-using request the model's own template cannot show: tool_templates.py), rendering
(bounded sandbox: chat_template.py; strict templates: chat_turns.py) and BOS handling."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.chat_template import MAX_RENDER_CHARS, MAX_TEMPLATE_CHARS
from pagedllm.entrypoints.chat_turns import render_fitted
from pagedllm.entrypoints.tool_templates import tool_template_for, uses_tools
from pagedllm.sampling_params import check_text

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
_TEMPLATE_DIR = Path(__file__).parent / "templates"
# Arguments `render_conversations` sets itself; chat_template_kwargs may not override them.
_RESERVED_KWARGS = {"conversation", "tokenize", "chat_template", "add_generation_prompt", "continue_final_message"}


def _content_text(content: Any, where: str) -> str:
    """A message's content as one string: templates are written for strings, and we
    support only text, so a list of OpenAI-style parts is joined here."""
    if content is None:  # e.g. an assistant message that only made tool calls
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def normalize_conversation(conversation: Any) -> list[dict[str, Any]]:
    """Validated copies of the messages (the caller's dicts are never modified)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError("a conversation must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(conversation):
        if not isinstance(msg, dict):
            raise ValueError(f"message {i}: must be a dict with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(f"message {i}: unknown role {role!r}; expected one of {list(ALLOWED_ROLES)}")
        out.append({**msg, "content": _content_text(msg.get("content"), f"message {i}")})
    return out


def split_conversations(messages: Any) -> list[Any]:
    """One conversation (a list of dicts) or a list of them → a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations")
    if all(isinstance(m, (list, tuple)) for m in messages):
        return list(messages)
    if any(isinstance(m, (list, tuple)) for m in messages):
        raise ValueError("messages mixes single messages and conversations")
    return [messages]


def is_gemma_tokenizer(tokenizer: Any) -> bool:
    """Gemma's turn markers are in its vocabulary: this needs only the tokenizer, so it also
    works for GGUF conversions and fine-tunes whose config names another model type."""
    try:
        tid = tokenizer.convert_tokens_to_ids("<start_of_turn>")
    except Exception:  # a tokenizer without the lookup is simply not recognised
        return False
    return isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None)


def fallback_template_name(tokenizer: Any) -> str | None:
    """The shipped template for the tokenizer's model family, if we ship one."""
    return "gemma" if is_gemma_tokenizer(tokenizer) else None


@functools.cache
def load_shipped_template(name: str) -> str:
    return (_TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def load_chat_template(chat_template: str) -> str:
    """An operator's or offline caller's template: Jinja text, or a path to a file holding it
    (read here, once). Never used for a template that arrives in a request."""
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError("chat_template must be a non-empty Jinja string or a path to a file holding one")
    path = os.path.expanduser(chat_template)
    if "\n" not in chat_template and len(chat_template) < 4096 and os.path.isfile(path):
        return Path(path).read_text(encoding="utf-8")
    if "{" not in chat_template:
        raise ValueError(f"chat_template {chat_template!r} is neither an existing file nor a Jinja template")
    return chat_template


def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str:
    """The explicit template (Jinja text or a file path) wins, then the tokenizer's own,
    then a shipped one for the model family; a model without any gets a clear error."""
    if chat_template is not None:
        return load_chat_template(chat_template)
    return default_chat_template(tokenizer)


def default_chat_template(tokenizer: Any) -> str:
    """The tokenizer's own template, else a shipped one for the model family."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one is the chat template
        own = own.get("default")
    if isinstance(own, str) and own:
        return own
    name = fallback_template_name(tokenizer)
    if name is not None:
        return load_shipped_template(name)
    tok_name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    raise ValueError(f"the tokenizer of {tok_name!r} has no chat template; pass chat_template=...")


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """bos_token, eos_token, ... as strings, the variables templates expect."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v if isinstance(v, (str, list)) else str(v) for k, v in tokens.items()}


def _avoid_double_bos(tokenizer: Any, text: str) -> str | dict[str, Any]:
    """The engine encodes string prompts with special tokens. If the template already wrote
    the BOS and the tokenizer adds another (Gemma's does), that would give two; hand the
    engine token ids encoded without special tokens instead (with the text, for the output)."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None or not text.startswith(bos):
        return text
    if tokenizer(text).input_ids[:2] != [bos_id, bos_id]:
        return text
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def render_conversations(
    tokenizer: Any,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    template_is_text: bool = False,
    max_chars: int = MAX_RENDER_CHARS,
) -> list[str | dict[str, Any]]:
    """One prompt per conversation: a string, or token ids where that avoids a double BOS.
    With `template_is_text`, `chat_template` is taken as Jinja text only, never as a path
    (a template from a request must not read files)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(chat_template_kwargs).__name__}")
    extra = dict(chat_template_kwargs or {})
    bad_keys = [k for k in extra if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"chat_template_kwargs keys must be strings, got {bad_keys[:3]}")
    clash = _RESERVED_KWARGS & set(extra)
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {sorted(clash)}; use the arguments of chat()")
    conversations = [normalize_conversation(c) for c in split_conversations(messages)]
    own = chat_template is None  # the model's (or the family's shipped) template, not a chosen one
    if template_is_text and chat_template is not None:
        if not isinstance(chat_template, str) or "{" not in chat_template:
            raise ValueError("chat_template must be Jinja template text")
        template, max_source = chat_template, MAX_TEMPLATE_CHARS  # a request's: untrusted
    else:
        template, max_source = resolve_chat_template(tokenizer, chat_template), None
    variables = {**_special_tokens(tokenizer), **extra}
    prompts: list[str | dict[str, Any]] = []
    for i, conv in enumerate(conversations):
        source = template
        if own and uses_tools(conv, extra.get("tools")):
            source = tool_template_for(tokenizer, template) or template
        try:
            text = render_fitted(
                source, conv, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, variables=variables, max_chars=max_chars,
                max_source_chars=max_source,
            )
        except ValueError as e:  # raise_exception(), an error, a limit: the input or template is at fault
            raise ValueError(f"conversation {i}: {e}") from None
        check_text(f"conversation {i}", text)  # a lone surrogate in a message would break the tokenizer
        prompts.append(_avoid_double_bos(tokenizer, text))
    return prompts
