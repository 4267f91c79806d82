"""A prompt record's images (``--multimodal-keys '{"image": KEY}'``): what a record may hold, and
opening them.

``record_images(where, key, value, base_dir)``: the record's ``KEY`` as a list of image references,
each one of

- a file path (``str``), relative to the data file's folder or absolute (resolved here);
- a ``data:image/...;base64,...`` URI (``str``), or an ``http(s)://`` URL (refused: no download);
- bytes (Parquet ``binary``), or a ``{"bytes": ..., "path": ...}`` struct (Hugging Face
  ``datasets``' image feature, as it writes Parquet);

a single reference stands for a list of one. ``open_image(ref)`` decodes one to an RGB PIL image
(raising ``ValueError`` with the reason); ``open_images(where, key, refs)`` all of a record's,
naming ``where`` (``file:line``) and the image's index on failure.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, List


def record_images(where: str, key: str, value: Any, base_dir: Path) -> List[Any]:
    """The record's image references (module docstring), paths resolved against ``base_dir``."""
    refs = value if isinstance(value, list) else [value]
    out = []
    for j, ref in enumerate(refs):
        if isinstance(ref, dict) and (ref.get("bytes") is not None or ref.get("path")):
            ref = ref["bytes"] if ref.get("bytes") is not None else ref["path"]
        if isinstance(ref, (bytes, bytearray)):
            out.append(bytes(ref))
        elif isinstance(ref, str) and ref.strip():
            if ref.startswith(("http://", "https://")):
                raise ValueError(
                    f"{where}: image {j} of {key!r} is a URL ({ref[:60]}); rl_plugin reads no network images. "
                    "Fix: download it and give its file path"
                )
            is_path = not ref.startswith("data:")
            out.append(str(base_dir / ref) if is_path and not Path(ref).is_absolute() else ref)
        else:
            raise ValueError(
                f"{where}: image {j} of {key!r} (--multimodal-keys) must be a file path, a data: URI or bytes, "
                f"got {type(ref).__name__} {str(ref)[:40]!r}"
            )
    return out


def open_image(ref):
    """An RGB ``PIL.Image`` of one reference (a resolved path, a data: URI, or bytes)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, bytes):
        source, what = io.BytesIO(ref), f"{len(ref)} bytes"
    elif ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if ";base64" not in head:
            raise ValueError(f"the data: URI {head[:40]!r} is not base64 (data:image/png;base64,...)")
        try:
            source, what = io.BytesIO(base64.b64decode(payload, validate=True)), "a data: URI"
        except ValueError as exc:
            raise ValueError(f"the data: URI's base64 does not decode ({exc})") from None
    else:
        if not Path(ref).is_file():
            raise ValueError(f"{ref}: no such file")
        source, what = ref, ref
    try:
        with Image.open(source) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{what} is not a readable image ({type(exc).__name__}: {exc})") from None


def open_images(where: str, key: str, refs: List[Any]) -> List[Any]:
    """Every image of a record, opened; a failure names ``where``, the key and the image's index."""
    out = []
    for j, ref in enumerate(refs):
        try:
            out.append(open_image(ref))
        except ValueError as exc:
            raise ValueError(f"{where}: image {j} of {key!r} (--multimodal-keys): {exc}") from None
    return out
