"""A LoRA checkpoint's ``lora.json``, written and checked in one place for both backends
(``rl_plugin.checkpoint.lora_meta``; issue 43 item 4, issue 44 item 4): a resume with another
``--lora-alpha`` (which would silently rescale the adapters' update), rank or target set is
refused naming both values and the flags that resume it; so is LoRA into a full run and back,
and another base. Real files: an HF directory's config and weights are fingerprinted."""

from __future__ import annotations

import json

import pytest

from rl_plugin.checkpoint.lora_meta import (
    LORA_META,
    LoraCheckpointError,
    base_identity,
    check_lora_meta,
    lora_meta,
    write_lora_meta,
)
from rl_plugin.configs.lora import LoraConfig


def _base(root, seed: int) -> str:
    d = root / f"base{seed}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "seed": seed}))
    (d / "model.safetensors").write_bytes(bytes([seed]) * 64)
    return str(d)


def _saved(root, base: str, **lora) -> str:
    """A step directory whose adapters were saved with ``LoraConfig(**lora)`` on ``base``."""
    step = root / "iter_0000001"
    step.mkdir(exist_ok=True)
    write_lora_meta(str(step), lora_meta(LoraConfig(**lora), base))
    return str(step)


def test_the_metadata_holds_rank_alpha_sorted_targets_and_the_base(tmp_path):
    base = _base(tmp_path, 0)
    step = _saved(tmp_path, base, lora_rank=4, lora_alpha=16.0, target_modules=("v_proj", "q_proj"))
    meta = json.loads((tmp_path / "iter_0000001" / LORA_META).read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 16.0, "targets": ["q_proj", "v_proj"]}
    assert meta["base"] == base_identity(base) and set(meta["base"]["weights"]) == {"model.safetensors"}
    assert lora_meta(LoraConfig(lora_rank=0), base) is None
    check_lora_meta(
        step, lora_meta(LoraConfig(lora_rank=4, lora_alpha=16.0, target_modules=("q_proj", "v_proj")), base)
    )
    check_lora_meta(str(tmp_path), None)  # a full-model checkpoint into a full run: nothing to compare


def test_another_alpha_is_refused_naming_both(tmp_path):
    """Issue 44 item 4: saved at --lora-alpha 16, resumed at 32 (the FSDP path resumed it silently,
    its adapter delta (alpha / r) B A doubled)."""
    base = _base(tmp_path, 0)
    step = _saved(tmp_path, base, lora_rank=8, lora_alpha=16.0)
    with pytest.raises(LoraCheckpointError) as err:
        check_lora_meta(step, lora_meta(LoraConfig(lora_rank=8, lora_alpha=32.0), base))
    msg = str(err.value)
    assert "--lora-alpha 16 in the checkpoint, 32 in this run" in msg, msg
    assert "--lora-rank" not in msg.split("Fix:")[0], msg  # only what differs is named before the fix
    assert msg.endswith("--lora-rank 8 --lora-alpha 16 --target-modules " + " ".join(sorted(meta_targets(step))))


def meta_targets(step: str):
    return json.loads(open(f"{step}/{LORA_META}").read())["lora"]["targets"]


@pytest.mark.parametrize(
    "now, words",
    [
        (dict(lora_rank=4, lora_alpha=16.0), "--lora-rank 8 in the checkpoint, 4 in this run"),
        (dict(lora_rank=8, lora_alpha=16.0, target_modules=("q_proj",)), "--target-modules down_proj"),
        (
            dict(lora_rank=4, lora_alpha=8.0),
            "--lora-rank 8 in the checkpoint, 4 in this run; --lora-alpha 16 in the checkpoint, 8 in this run",
        ),
    ],
    ids=["rank", "targets", "rank_and_alpha"],
)
def test_another_adapter_shape_is_refused(tmp_path, now, words):
    base = _base(tmp_path, 0)
    step = _saved(tmp_path, base, lora_rank=8, lora_alpha=16.0)
    with pytest.raises(LoraCheckpointError, match="Fix: resume with the checkpoint's --lora-rank 8") as err:
        check_lora_meta(step, lora_meta(LoraConfig(**now), base))
    assert words in str(err.value), str(err.value)
    if "targets" in now:
        assert "in the checkpoint, q_proj in this run" in str(err.value)


def test_lora_ness_and_base_are_checked(tmp_path):
    base, other = _base(tmp_path, 0), _base(tmp_path, 1)
    step = _saved(tmp_path, base, lora_rank=8, lora_alpha=16.0)
    with pytest.raises(LoraCheckpointError, match="a LoRA checkpoint .* this run trains the whole model") as err:
        check_lora_meta(step, None)
    assert "--lora-rank 8 --lora-alpha 16 --target-modules" in str(err.value)
    with pytest.raises(LoraCheckpointError, match=r"a full-model checkpoint \(no lora.json\)"):
        check_lora_meta(str(tmp_path), lora_meta(LoraConfig(lora_rank=8), base))
    with pytest.raises(LoraCheckpointError, match="trained on the base model") as err:
        check_lora_meta(step, lora_meta(LoraConfig(lora_rank=8, lora_alpha=16.0), other))
    assert base in str(err.value) and other in str(err.value)
