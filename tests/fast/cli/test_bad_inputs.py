"""Bad input refused before any work, naming the file:line or the flag, the rule and the fix
(the items of the reliability sweep that need neither Ray nor a model; malformed JSON, a
missing --input-key / --label-key and non-finite rewards are in rollout/test_parts and
e2e/test_loop, another model's --load in backends/megatron/test_reshard)."""

from __future__ import annotations

import json

import pytest

from rl_plugin.rollout.data.dataset import read_jsonl


@pytest.mark.parametrize(
    "line, rule",
    [
        ('{"prompt": "", "label": "1"}', "'prompt' is empty"),
        ('{"prompt": "  \\n ", "label": "1"}', "'prompt' is empty"),
        ("{}", "no key 'prompt' (--input-key)"),
        ("null", "expected a JSON object, got NoneType"),
        ('""', "expected a JSON object, got str"),
        ('{"prompt": "12=", "label": "1"', "not valid JSON"),
    ],
)
def test_bad_prompt_line_is_named(tmp_path, line, rule):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1=", "label": "1"}\n\n' + line + "\n")  # the blank line 2 holds no record: skipped
    with pytest.raises(ValueError) as info:
        read_jsonl(p, "prompt", "label")
    assert str(info.value).startswith(f"{p}:3: {rule}"), str(info.value)


def test_blank_lines_are_skipped_and_records_kept_in_order(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"{i}=", "label": str(i)}) for i in range(3)) + "\n\n  \n")
    assert [r.prompt for r in read_jsonl(p, "prompt", "label")] == ["0=", "1=", "2="]


def test_hf_checkpoint_without_weights_is_refused_before_ray(tmp_path, capsys):
    from rl_plugin.models.tiny import tiny_config
    from rl_plugin.train import main

    model = tmp_path / "model"
    tiny_config("qwen2").save_pretrained(model)  # config.json only: an interrupted download
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12=", "label": "12"}\n')
    argv = [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "1",
        "--rm-type",
        "digit_match",
        "--output-dir",
        str(tmp_path / "o"),
        "--no-progress-bar",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"--hf-checkpoint {model}: no weight files there (*.safetensors or pytorch_model*.bin); it holds ['config.json']"
        in err
    ), err
    assert "Fix: download the complete model" in err
