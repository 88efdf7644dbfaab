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


# OpenAI's image parts (chat: image_url; Responses: input_image) and vLLM's offline image_pil.
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil")


def _image_source(part: dict[str, Any], where: str) -> Any:
    """An image part's image: a URL string, or (image_pil) the PIL image itself."""
    kind = part["type"]
    if kind == "image_pil":
        return part.get("image_pil")
    value = part.get("image_url")
    if isinstance(value, dict):  # chat: {"image_url": {"url": ...}}; Responses: {"image_url": "..."}
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: an {kind} part needs an image URL")
    return value


def _content(content: Any, where: str, images: list[Any] | None) -> str | list[dict[str, Any]]:
    """A message's content: a string, or, where it has images (appended to `images`), its parts as
    [{"type": "text", "text": ...}, {"type": "image"}, ...] in order. `images` None: the model
    takes no images, and an image part is an error."""
    if content is None:  # e.g. an assistant message that only made tool calls
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES and images is not None:
            images.append(_image_source(part, where))
            parts.append({"type": "image"})
        elif kind in IMAGE_PART_TYPES:
            raise ValueError(f"{where}: this model takes no images (an {kind} part); it is a text-only model")
        else:
            raise ValueError(f"{where}: unsupported content part {kind!r}; supported: text"
                             + ("" if images is None else ", image_url, input_image, image_pil"))
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _as_string(parts: list[dict[str, Any]], placeholder: str) -> str:
    """Image parts for a template that takes string content: the placeholders first, a line
    each, then the text (vLLM's string content format)."""
    n = sum(p["type"] == "image" for p in parts)
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    return "\n".join([placeholder] * n + ([text] if text else []))


def normalize_conversation(conversation: Any, images: list[Any] | None = None,
                           image_placeholder: str | None = None) -> list[dict[str, Any]]:
    """Validated copies of the messages (the caller's dicts are never modified). With `images`
    (a list to fill), image parts are taken: a message with images keeps its parts as a list,
    or with `image_placeholder` becomes a string with that placeholder per image."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError("a conversation must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(conversation):
        if not isinstance(msg, dict):
            raise ValueError(f"message {i}: must be a dict with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(f"message {i}: unknown role {role!r}; expected one of {list(ALLOWED_ROLES)}")
        content = _content(msg.get("content"), f"message {i}", images)
        if isinstance(content, list) and image_placeholder is not None:
            content = _as_string(content, image_placeholder)
        out.append({**msg, "content": content})
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
    image_placeholder: str | None = None,
) -> list[str | dict[str, Any]]:
    """One prompt per conversation: a string, or token ids where that avoids a double BOS.
    With `template_is_text`, `chat_template` is taken as Jinja text only, never as a path
    (a template from a request must not read files). With `image_placeholder` (a vision-language
    model's, e.g. "<image>"), image parts are taken: such a conversation's prompt is a dict with
    `multi_modal_data` {"image": [their URLs or PIL images]}, its text holding one placeholder per
    image: where the template puts it for image parts, else before the message's text."""
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
    conversations = split_conversations(messages)
    own = chat_template is None  # the model's (or the family's shipped) template, not a chosen one
    if template_is_text and chat_template is not None:
        if not isinstance(chat_template, str) or "{" not in chat_template:
            raise ValueError("chat_template must be Jinja template text")
        template, max_source = chat_template, MAX_TEMPLATE_CHARS  # a request's: untrusted
    else:
        template, max_source = resolve_chat_template(tokenizer, chat_template), None
    variables = {**_special_tokens(tokenizer), **extra}
    prompts: list[str | dict[str, Any]] = []
    for i, raw in enumerate(conversations):
        images: list[Any] | None = [] if image_placeholder is not None else None
        conv = normalize_conversation(raw, images)
        source = template
        if own and uses_tools(conv, extra.get("tools")):
            source = tool_template_for(tokenizer, template) or template

        def render(conv: list[dict[str, Any]], i: int = i, source: str = source) -> str:
            try:
                return render_fitted(
                    source, conv, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, variables=variables, max_chars=max_chars,
                    max_source_chars=max_source,
                )
            except ValueError as e:  # raise_exception(), an error, a limit: the input or template is at fault
                raise ValueError(f"conversation {i}: {e}") from None

        if images:
            try:
                text = render(conv)  # the template's own image handling, if it has one
            except ValueError:
                text = ""
            if text.count(image_placeholder) != len(images):  # it takes strings: placeholders in the text
                text = render(normalize_conversation(raw, [], image_placeholder))
        else:
            text = render(conv)
        check_text(f"conversation {i}", text)  # a lone surrogate in a message would break the tokenizer
        prompt = _avoid_double_bos(tokenizer, text)
        if images:
            prompt = {**(prompt if isinstance(prompt, dict) else {"prompt": prompt}),
                      "multi_modal_data": {"image": images}}
        prompts.append(prompt)
    return prompts
