"""Image URLs under the operator's rules, against a real local HTTP server: loopback is refused
unless its host is allowed, an empty allow-list fetches nothing, and size cap, timeout, redirects
and file:// confinement hold."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from pagedllm.entrypoints.media import MediaConnector
from tests.utils import data_url, random_image


@pytest.fixture(scope="module")
def png() -> bytes:
    import base64

    return base64.b64decode(data_url(random_image(0)).split(",", 1)[1])


@pytest.fixture(scope="module")
def server(png):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/slow.png":
                time.sleep(2)
            if self.path == "/redirect.png":
                self.send_response(302)
                self.send_header("Location", "/img.png")
                self.end_headers()
                return
            body = png if self.path in ("/img.png", "/slow.png") else b"x" * 4096
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_loopback_is_refused_by_default(server):
    with pytest.raises(ValueError, match="non-public address"):
        MediaConnector().load_image(f"{server}/img.png")
    with pytest.raises(ValueError, match="non-public address"):
        MediaConnector().load_image(server.replace("127.0.0.1", "localhost") + "/img.png")


def test_an_allowed_host_is_fetched(server):
    img = MediaConnector(allowed_media_domains=["127.0.0.1"]).load_image(f"{server}/img.png")
    assert img.size == random_image(0).size and img.tobytes() == random_image(0).tobytes()


def test_an_empty_allow_list_fetches_nothing(server):
    with pytest.raises(ValueError, match="fetches no image URLs"):
        MediaConnector(allowed_media_domains=[]).load_image(f"{server}/img.png")
    with pytest.raises(ValueError, match="not in --allowed-media-domains"):
        MediaConnector(allowed_media_domains=["example.com"]).load_image(f"{server}/img.png")


def test_size_cap_timeout_and_redirects(server):
    allowed = ["127.0.0.1"]
    with pytest.raises(ValueError, match="more than the 1000"):
        MediaConnector(allowed_media_domains=allowed, max_bytes=1000).load_image(f"{server}/big.png")
    start = time.monotonic()
    with pytest.raises(ValueError, match="took more than 0.5 s"):
        MediaConnector(allowed_media_domains=allowed, timeout=0.5).load_image(f"{server}/slow.png")
    assert time.monotonic() - start < 1.8
    with pytest.raises(ValueError, match="redirects are not followed"):
        MediaConnector(allowed_media_domains=allowed).load_image(f"{server}/redirect.png")
    with pytest.raises(ValueError, match="cannot read the image"):
        MediaConnector(allowed_media_domains=allowed).load_image(f"{server}/not-an-image")


def test_file_urls_only_under_the_allowed_path(tmp_path, png):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        MediaConnector().load_image(f"file://{tmp_path}/media/a.png")
    connector = MediaConnector(allowed_local_media_path=str(tmp_path / "media"))
    assert connector.load_image(f"file://{tmp_path}/media/a.png").size == random_image(0).size
    for escape in (f"file://{tmp_path}/secret.png", f"file://{tmp_path}/media/../secret.png"):
        with pytest.raises(ValueError, match="outside"):
            connector.load_image(escape)


def test_data_urls_and_bad_schemes():
    assert MediaConnector().load_image(data_url(random_image(1))).size == (50, 40)
    with pytest.raises(ValueError, match="base64"):
        MediaConnector().load_image("data:image/png;base64,!!!")
    with pytest.raises(ValueError, match="unsupported image URL scheme"):
        MediaConnector().load_image("ftp://example.com/a.png")
