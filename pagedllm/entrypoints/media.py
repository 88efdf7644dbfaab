"""Images named by URL in chat messages, fetched under the operator's rules.

- `data:` URLs always (decoded here);
- `file://` only under `allowed_local_media_path` (resolved, so `..` and links cannot leave it);
- `http(s)://`: never when `allowed_media_domains` is an empty list; with a list, only those
  hosts; with none given, any host whose addresses are all public: a loopback, private,
  link-local or reserved address is refused unless its host is listed, so a server cannot be
  made a proxy into the operator's network. Redirects are not followed (each hop would need the
  same check). A fetch has a timeout and a size cap.
Every refusal or failure is a ValueError naming the rule, which the server answers with HTTP 400.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pagedllm import envs
from pagedllm.multimodal.image import image_from_bytes, load_image

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds for one image fetch (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)
DEFAULT_MAX_BYTES = 20 << 20  # largest image file fetched or read


@dataclass(slots=True)
class MediaConnector:
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None  # None: any public host; []: no fetching
    timeout: float = DEFAULT_FETCH_TIMEOUT
    max_bytes: int = DEFAULT_MAX_BYTES
    _root: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.allowed_local_media_path:
            self._root = Path(self.allowed_local_media_path).resolve()
            if not self._root.is_dir():
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")

    def load_image(self, source: Any, where: str = "image") -> Any:
        """A URL (data:, file://, http(s)://), bytes or a PIL image → an RGB PIL image. Blocking:
        the server calls it in a worker thread."""
        if not isinstance(source, str):
            return load_image(source, where)
        scheme = urlsplit(source).scheme.lower()
        if scheme == "data":
            return load_image(source, where)
        if scheme == "file":
            return image_from_bytes(self._read_file(source, where), where)
        if scheme in ("http", "https"):
            return image_from_bytes(self._fetch(source, where), where)
        raise ValueError(f"{where}: unsupported image URL scheme {scheme or source[:16]!r}; use data:, http(s): "
                         "or file:")

    # ---- file:// ------------------------------------------------------------
    def _read_file(self, url: str, where: str) -> bytes:
        if self._root is None:
            raise ValueError(f"{where}: file:// URLs are refused; the server allows them only under "
                             "--allowed-local-media-path")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{where}: a file:// URL names no host")
        path = Path(unquote(parts.path)).resolve()
        if not path.is_relative_to(self._root):
            raise ValueError(f"{where}: {path} is outside --allowed-local-media-path ({self._root})")
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                raise ValueError(f"{where}: the file is {size} bytes, more than the {self.max_bytes} allowed")
            return path.read_bytes()
        except OSError as e:
            raise ValueError(f"{where}: cannot read {path}: {e.strerror or e}") from None

    # ---- http(s):// ---------------------------------------------------------
    def check_url(self, url: str, where: str = "image") -> None:
        """The host rules, before any connection."""
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        if not host:
            raise ValueError(f"{where}: the image URL has no host")
        domains = self.allowed_media_domains
        if domains is not None:
            if not domains:
                raise ValueError(f"{where}: this server fetches no image URLs (--allowed-media-domains is empty); "
                                 "send the image as a data: URL")
            if host not in {d.lower().rstrip(".") for d in domains}:
                raise ValueError(f"{where}: host {host!r} is not in --allowed-media-domains")
            return  # the operator listed it: private addresses included
        for addr in _addresses(host, urlsplit(url).port, where):
            if not addr.is_global:
                raise ValueError(f"{where}: host {host!r} resolves to a non-public address ({addr}); list the "
                                 "host in --allowed-media-domains to allow it")

    def _fetch(self, url: str, where: str) -> bytes:
        import httpx

        self.check_url(url, where)
        try:
            with httpx.Client(timeout=self.timeout, follow_redirects=False, trust_env=False) as client, \
                    client.stream("GET", url) as response:
                if response.is_redirect:
                    raise ValueError(f"{where}: the image URL redirects ({response.status_code}); redirects are "
                                     "not followed: give the final URL")
                if response.status_code != 200:
                    raise ValueError(f"{where}: fetching the image gave HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > self.max_bytes:
                    raise ValueError(f"{where}: the image is {declared} bytes, more than the {self.max_bytes} allowed")
                chunks, total = [], 0
                for chunk in response.iter_bytes():
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise ValueError(f"{where}: the image is more than the {self.max_bytes} bytes allowed")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.TimeoutException:
            raise ValueError(f"{where}: fetching the image took more than {self.timeout:g} s") from None
        except httpx.HTTPError as e:
            raise ValueError(f"{where}: fetching the image failed: {type(e).__name__}: {e}") from None


def _addresses(host: str, port: int | None, where: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port or 443, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"{where}: cannot resolve host {host!r}: {e.strerror}") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def connector_from_env(allowed_local_media_path: str | None, allowed_media_domains: list[str] | None) -> MediaConnector:
    """The connector for the engine's rules, its timeout from PAGEDLLM_MEDIA_FETCH_TIMEOUT."""
    value = envs.PAGEDLLM_MEDIA_FETCH_TIMEOUT
    try:
        timeout = float(value) if value else DEFAULT_FETCH_TIMEOUT
    except ValueError:
        raise ValueError(f"PAGEDLLM_MEDIA_FETCH_TIMEOUT must be a number of seconds, got {value!r}") from None
    return MediaConnector(allowed_local_media_path, allowed_media_domains, timeout)
