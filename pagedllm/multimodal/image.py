"""Images as users hand them over (PIL images, raw bytes, `data:` URLs), checked and made RGB,
and their content hash."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

# Larger images are refused before decoding: PIL's own bomb check allows ~179 MPixel.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # Pillow comes with transformers' image processors; say so if absent
        raise ValueError("images need Pillow: pip install pillow") from e
    return Image


def image_from_bytes(data: bytes, where: str = "image") -> Any:
    """Decode an encoded image (PNG, JPEG, ...) fully now, so a truncated or corrupt one is the
    caller's error here and not the processor's later."""
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: {img.width}x{img.height} pixels is more than {MAX_IMAGE_PIXELS}")
            img.load()
            return img.convert("RGB")
    except ValueError:
        raise
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, DecompressionBombError...
        raise ValueError(f"{where}: cannot read the image ({type(e).__name__}: {e})") from None


def image_from_data_url(url: str, where: str = "image") -> Any:
    """`data:image/png;base64,....` → an RGB image."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError(f"{where}: a data URL must look like data:image/png;base64,<data>")
    mime = header[5:].removesuffix(";base64")
    if mime and not mime.startswith("image/"):
        raise ValueError(f"{where}: a data URL of type {mime!r} is not an image")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data URL's base64 does not decode") from None
    return image_from_bytes(data, where)


def load_image(item: Any, where: str = "image") -> Any:
    """A PIL image (made RGB), raw bytes, or a `data:` URL → an RGB PIL image."""
    Image = _pil()
    if isinstance(item, Image.Image):
        if item.width * item.height == 0:
            raise ValueError(f"{where}: the image is empty ({item.width}x{item.height})")
        return item if item.mode == "RGB" else item.convert("RGB")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return image_from_bytes(bytes(item), where)
    if isinstance(item, str) and item.startswith("data:"):
        return image_from_data_url(item, where)
    raise ValueError(f"{where}: expected a PIL image, bytes or a data: URL, got {type(item).__name__}")


def hash_image(image: Any, salt: str = "") -> str:
    """sha256 of the decoded pixels (mode, size, bytes): the same picture from a PNG or a PIL image
    is one entry of the caches; `salt` carries what else changes the processed inputs."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.width}x{image.height}:{salt}".encode())
    h.update(image.tobytes())
    return h.hexdigest()
