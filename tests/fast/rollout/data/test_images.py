"""A record's images: the references a record may hold, and each refusal naming the record and image."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from rl_plugin.rollout.data.images import open_image, open_images, record_images


def _png(rgb=(10, 20, 30), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return buf.getvalue()


def test_paths_data_uris_bytes_and_hf_structs_open_alike(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    refs = record_images("f:1", "images", ["a.png", uri, _png(), {"bytes": _png(), "path": None}], tmp_path)
    assert refs[0] == str(tmp_path / "a.png")
    imgs = open_images("f:1", "images", refs)
    assert [i.size for i in imgs] == [(8, 6)] * 4 and {i.getpixel((0, 0)) for i in imgs} == {(10, 20, 30)}
    assert record_images("f:1", "images", "a.png", tmp_path) == [str(tmp_path / "a.png")]  # one image, no list


@pytest.mark.parametrize(
    "value, fragment",
    [
        ([3], "image 0 of 'images' (--multimodal-keys) must be a file path, a data: URI or bytes, got int"),
        (["ok.png", ""], "image 1 of 'images' (--multimodal-keys) must be a file path"),
        (["https://x/y.png"], "image 0 of 'images' is a URL"),
    ],
)
def test_bad_references_name_the_record_and_the_image(tmp_path, value, fragment):
    with pytest.raises(ValueError) as err:
        record_images("d.jsonl:7", "images", value, tmp_path)
    assert str(err.value).startswith("d.jsonl:7: ") and fragment in str(err.value)


def test_missing_and_undecodable_images_name_the_record_and_the_image(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(
        ValueError, match=r"^d.jsonl:3: image 1 of 'images' \(--multimodal-keys\): .*gone.png: no such file"
    ):
        open_images("d.jsonl:3", "images", [_png(), str(tmp_path / "gone.png")])
    with pytest.raises(ValueError, match=r"^d.jsonl:4: image 0 of 'images' .*bad.png is not a readable image"):
        open_images("d.jsonl:4", "images", [str(tmp_path / "bad.png")])
    with pytest.raises(ValueError, match="is not base64"):
        open_image("data:image/png,abc")
    with pytest.raises(ValueError, match="does not decode"):
        open_image("data:image/png;base64,@@@")
