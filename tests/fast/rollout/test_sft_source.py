"""The SFT source (``rl_plugin.rollout.sft_source.SftSource``) on the character tokenizer: batch k
is the next ``--rollout-batch-size`` prompt + completion pairs in the loss core's flat layout
(response = the completion and its ``<eos>``, mask 1 on it), no log-probs and no rewards, each
conversation its own group; the position wraps into epochs, saves and resumes in the manager's
form; eval data is every held-out pair; a bad record fails at construction naming its line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rl_plugin.configs import RolloutConfig
from rl_plugin.rollout.data.tokenizer import CharTokenizer
from rl_plugin.rollout.sft_source import SftSource, read_sft_records

PAIRS = [("12=", "21"), ("345=", "543"), ("6=", "6"), ("78=", "87"), ("9=", "9")]


def _files(tmp_path, pairs=PAIRS, eval_pairs=()):
    ck = tmp_path / "ck"
    ck.mkdir()
    CharTokenizer("0123456789=").save(ck)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": p, "label": c}) + "\n" for p, c in pairs))
    ev = tmp_path / "eval.jsonl"
    ev.write_text("".join(json.dumps({"prompt": p, "label": c}) + "\n" for p, c in eval_pairs))
    return ck, train, ev


def _cfg(train, **kw):
    return dataclasses.replace(RolloutConfig(), prompt_data=str(train), rollout_batch_size=2, **kw)


def _ids(tok, prompt, completion):
    p, c = tok.prompt_ids(prompt), tok.encode(completion) + [tok.eos_token_id]
    return p, c


def test_batches_are_the_next_pairs_in_the_flat_layout(tmp_path):
    ck, train, _ = _files(tmp_path)
    src = SftSource(_cfg(train), str(ck))
    tok = CharTokenizer("0123456789=")
    data = src.rollout(0)
    (p0, c0), (p1, c1) = _ids(tok, *PAIRS[0]), _ids(tok, *PAIRS[1])
    assert data.tokens.tolist() == p0 + c0 + p1 + c1
    assert data.total_lengths.tolist() == [len(p0 + c0), len(p1 + c1)]
    assert data.response_lengths.tolist() == [len(c0), len(c1)] == [3, 4]
    assert torch.equal(data.loss_mask, torch.ones(7))
    assert data.rollout_log_probs is None and data.rewards is None
    assert data.group_ids.tolist() == [0, 1] and data.num_groups == 2
    assert data.stats == {"response_len_mean": 3.5, "truncated_frac": 0.0}
    assert data.dataset_state == {"train_dataset": {"epoch": 0, "offset": 2}}


def test_the_position_wraps_and_resumes(tmp_path):
    ck, train, _ = _files(tmp_path)
    src = SftSource(_cfg(train), str(ck))
    src.rollout(0)
    src.rollout(1)
    state = src.state_dict()
    assert state == {"train_dataset": {"epoch": 0, "offset": 4}}
    third = src.rollout(2)  # record 4, then record 0 of the next epoch
    tok = CharTokenizer("0123456789=")
    assert third.tokens.tolist() == sum(_ids(tok, *PAIRS[4]), []) + sum(_ids(tok, *PAIRS[0]), [])
    assert third.dataset_state == {"train_dataset": {"epoch": 1, "offset": 1}}
    resumed = SftSource(_cfg(train), str(ck))
    resumed.load_state_dict(state)
    assert torch.equal(resumed.rollout(2).tokens, third.tokens)


def test_eval_data_is_every_held_out_pair(tmp_path):
    ck, train, ev = _files(tmp_path, eval_pairs=[("11=", "11"), ("2=", "2"), ("3=", "3")])
    assert SftSource(_cfg(train), str(ck)).eval_data() is None
    src = SftSource(_cfg(train, eval_prompt_data=str(ev)), str(ck))
    data = src.eval_data()
    assert data.num_groups == 3 and data.response_lengths.tolist() == [3, 2, 2]


def test_records_without_a_completion_are_optional_to_read_but_refused_to_train(tmp_path):
    ck, train, _ = _files(tmp_path)
    train.write_text(json.dumps({"prompt": "1="}) + "\n" + json.dumps({"prompt": "2=", "label": "2"}) + "\n")
    recs = read_sft_records(train, _cfg(train))
    assert [r.label for r in recs] == [None, "2"]
    with pytest.raises(ValueError) as info:
        SftSource(_cfg(train), str(ck))
    assert str(info.value) == (
        f"{train}:1: the checkpoint's character tokenizer has no chat template, so SFT needs a prompt string "
        "(--input-key) and its completion string (--label-key)"
    )
