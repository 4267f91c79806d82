"""``make_source`` (``rl_plugin.rollout.source``): the one place a mode's kind becomes a source;
an unknown kind is refused listing the kinds. (Each source's behaviour: ``test_sft_source``,
``generation/``, ``fully_async/``.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from rl_plugin.configs import RolloutConfig
from rl_plugin.configs.mode import Mode
from rl_plugin.rollout.data.tokenizer import CharTokenizer
from rl_plugin.rollout.sft_source import SftSource
from rl_plugin.rollout.source import FULLY_ASYNC, GENERATION, KINDS, SFT, make_source


def test_the_kinds():
    assert KINDS == ("generation", "fully_async", "sft") == (GENERATION, FULLY_ASYNC, SFT)


def test_generation_is_the_generation_source_itself():
    generation = object()
    assert make_source(GENERATION, generation=generation, fleet=None) is generation


def test_sft_builds_the_sft_source_from_its_config(tmp_path):
    CharTokenizer("0123456789=").save(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1=", "label": "1"}) + "\n")
    cfg = dataclasses.replace(RolloutConfig(), prompt_data=str(data), rollout_batch_size=1)
    src = make_source(SFT, config=cfg, checkpoint_dir=str(tmp_path))
    assert isinstance(src, SftSource) and src.rollout(0).num_groups == 1


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"^unknown rollout source 'offline' \(one of generation, fully_async, sft\)$"):
        make_source("offline")


def test_every_mode_names_a_known_kind_and_every_kind_has_a_mode():
    assert {m.source for m in Mode} == set(KINDS)
