"""`pagedllm chat` and `pagedllm complete`: talk to a running OpenAI-compatible server from the
terminal, tokens printed as they stream. Plain httpx with server-sent events, so the `openai`
package is not needed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from pagedllm import envs

API_KEY_ENVS = ("OPENAI_API_KEY", "PAGEDLLM_API_KEY")
PROMPT = "> "


def add_chat_parsers(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="chat with a running server, streaming the replies")
    _add_client_args(chat)
    chat.add_argument("--system-prompt", default=None, help="the conversation's system message")
    chat.set_defaults(func=run_chat)
    complete = subparsers.add_parser("complete", help="complete prompts on a running server, streaming the text")
    _add_client_args(complete)
    complete.set_defaults(func=run_complete)


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://localhost:8000/v1", help="the server's API base (default: %(default)s)")
    p.add_argument("--model-name", default=None, help="the model to use (default: the server's first)")
    p.add_argument("--api-key", default=None, help=f"bearer key (default: ${' or $'.join(API_KEY_ENVS)})")
    p.add_argument("-q", "--quick", default=None, metavar="TEXT", help="send this one message, print the reply, exit")
    p.add_argument("--max-tokens", type=int, default=None, help="longest reply (default: the server's)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")


class Client:
    """The server at `--url`: the model name and streamed requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        key = args.api_key or next((getattr(envs, e) for e in API_KEY_ENVS if getattr(envs, e)), None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = args.url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(30.0, read=None))
        self.params = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
                       if v is not None}
        self.model = args.model_name or self._first_model()

    def _first_model(self) -> str:
        models = self._check(self._request("GET", "/models")).json().get("data") or []
        if not models:
            raise ValueError(f"{self.url}/models lists no model")
        return models[0]["id"]

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            return self.http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise ValueError(f"cannot reach the server at {self.url}: {e}") from None

    def _check(self, resp: Any) -> Any:
        if resp.status_code != 200:
            resp.read()
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:500]
            raise ValueError(f"{resp.request.url}: HTTP {resp.status_code}: {message}")
        return resp

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON chunks of a streamed request."""
        import httpx

        body = {"model": self.model, **self.params, **body, "stream": True}
        try:
            with self.http.stream("POST", path, json=body) as resp:
                self._check(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ValueError(f"server error: {chunk['error'].get('message', chunk['error'])}")
                    yield chunk
        except httpx.TransportError as e:
            raise ValueError(f"lost the server at {self.url}: {e}") from None


def _print_stream(pieces: Iterator[str]) -> str:
    """Write each piece as it comes; the whole text. Ctrl-C stops the reply, keeping what came."""
    text = []
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            text.append(piece)
    except KeyboardInterrupt:
        pass
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _chat_pieces(client: Client, messages: list[dict[str, str]]) -> Iterator[str]:
    for chunk in client.stream("/chat/completions", {"messages": messages}):
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                yield choice["delta"]["content"]


def _completion_pieces(client: Client, prompt: str) -> Iterator[str]:
    for chunk in client.stream("/completions", {"prompt": prompt}):
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                yield choice["text"]


def _read_line() -> str | None:
    """The next line typed after the prompt; None at EOF (Ctrl-D), Ctrl-C, or 'exit'/'quit'."""
    sys.stdout.write(PROMPT)
    sys.stdout.flush()
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        line = ""
    if not line or line.strip() in ("exit", "quit"):
        if not line:
            sys.stdout.write("\n")
        return None
    return line.rstrip("\n")


def run_chat(args: argparse.Namespace) -> int:
    client = Client(args)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    if args.quick is not None:
        messages.append({"role": "user", "content": args.quick})
        _print_stream(_chat_pieces(client, messages))
        return 0
    print(f"Chatting with {client.model} at {client.url}; Ctrl-D or 'exit' quits.", file=sys.stderr)
    while (line := _read_line()) is not None:
        messages.append({"role": "user", "content": line})
        try:
            reply = _print_stream(_chat_pieces(client, messages))
        except ValueError as e:  # a refused request: say why and let the user go on
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


def run_complete(args: argparse.Namespace) -> int:
    client = Client(args)
    if args.quick is not None:
        _print_stream(_completion_pieces(client, args.quick))
        return 0
    print(f"Completing with {client.model} at {client.url}; Ctrl-D or 'exit' quits.", file=sys.stderr)
    while (line := _read_line()) is not None:
        try:
            _print_stream(_completion_pieces(client, line))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
    return 0
