"""Prompt records with images (``--multimodal-keys``): JSONL paths, Parquet bytes, chat image parts."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from rl_plugin.rollout.data.dataset import read_prompts
from rl_plugin.rollout.data.images import open_images


def _png(rgb) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), rgb).save(buf, format="PNG")
    return buf.getvalue()


def test_jsonl_paths_resolve_against_the_data_file(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png((1, 2, 3)))
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "<image>x", "images": ["img/a.png"], "label": 0}) + "\n")
    (rec,) = read_prompts(path, "prompt", "label", image_key="images")
    assert rec.images == [str(tmp_path / "img" / "a.png")] and rec.where == f"{path}:1"
    assert open_images(rec.where, "images", rec.images)[0].getpixel((0, 0)) == (1, 2, 3)
    (plain,) = read_prompts(path, "prompt", "label")
    assert plain.images is None  # without --multimodal-keys the key is not read


def test_parquet_bytes_and_chat_image_parts(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    chat = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Hi"}]}
    ]
    rows = {"prompt": [json.dumps(chat)], "images": [[_png((9, 9, 9))]], "label": ["a"]}
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": [chat], "images": rows["images"], "label": rows["label"]})
    pq.write_table(table, path)
    (rec,) = read_prompts(path, "prompt", "label", image_key="images")
    assert rec.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert rec.text == "Hi" and isinstance(rec.images[0], bytes)
    assert open_images(rec.where, "images", rec.images)[0].getpixel((0, 0)) == (9, 9, 9)


def test_content_parts_are_refused_without_images_and_bad_parts_with(tmp_path):
    path = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}]}]
    path.write_text(json.dumps({"prompt": chat, "images": [], "label": 0}) + "\n")
    with pytest.raises(ValueError, match="gives its content as a list of parts"):
        read_prompts(path, "prompt", "label")
    with pytest.raises(ValueError, match=r"d.jsonl:1: part 1 of message 0 of 'prompt' must be"):
        read_prompts(path, "prompt", "label", image_key="images")
