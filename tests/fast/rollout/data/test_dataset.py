"""Prompt datasets (``rl_plugin.rollout.data.dataset``): errors name the file and line, and the
position resumes across epochs."""

import json

import pytest

from rl_plugin.rollout.data.dataset import PromptDataset, read_jsonl


def test_dataset_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "label": 1}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: no key 'prompt' \(--input-key\)"):
        read_jsonl(p, "prompt", "label")
    p.write_text('{"prompt": "a", "label": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        read_jsonl(p, "prompt", "label")
    p.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: no key 'label' \(--label-key\)"):
        read_jsonl(p, "prompt", "label")
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        read_jsonl(tmp_path / "missing.jsonl", "prompt", None)


def test_dataset_position_resumes_across_epochs(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"q": str(i)}) + "\n" for i in range(5)))
    ds = PromptDataset.from_jsonl(p, "q", None, shuffle=True, seed=3)
    ds.next_batch(4)
    state = ds.state_dict()
    expected = [r.prompt for r in ds.next_batch(7)]  # wraps into epochs 1 and 2 (reshuffled)
    other = PromptDataset.from_jsonl(p, "q", None, shuffle=True, seed=3)
    other.load_state_dict(state)
    assert [r.prompt for r in other.next_batch(7)] == expected
    assert state == {"epoch": 0, "offset": 4}
