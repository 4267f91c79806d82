"""The embedded default's files (``rl_plugin.loop.embedded_setup``): the tiny model and its char
tokenizer built once under ``$RL_PLUGIN_CACHE`` and reused, the digit-copy task's two splits, and
``prepare_embedded`` filling them into the flags and the run config (a given ``--hf-checkpoint``
kept)."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs.run import RunConfig
from rl_plugin.loop.embedded_setup import (
    MODEL,
    NUM_DIGITS,
    cache_root,
    ensure_task_data,
    ensure_tiny_model,
    prepare_embedded,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the model is built once (a few seconds)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RL_PLUGIN_CACHE", str(root))
        yield root


def test_the_cache_root_is_the_environments_or_outputs(monkeypatch, tmp_path):
    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("RL_PLUGIN_CACHE")
    assert str(cache_root()) == "outputs"


def test_the_tiny_model_is_built_once_with_the_declared_sizes(cache):
    path = ensure_tiny_model(cache)
    assert path == cache / "tiny_model" / "qwen2-v16-h64-a2-l2-seed0"
    assert {"config.json", "char_tokenizer.json", "model.safetensors"} <= {p.name for p in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (16, 64, 2)
    assert config["hidden_size"] // config["num_attention_heads"] == 32  # vLLM's CPU attention: head_dim >= 32
    assert (config["intermediate_size"], config["max_position_embeddings"]) == (
        MODEL["intermediate_size"],
        MODEL["max_position_embeddings"],
    )
    weights = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(cache) == path and (path / "model.safetensors").stat().st_mtime_ns == weights  # reused
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]  # no temporary left


def test_the_task_has_a_train_and_a_held_out_split(cache):
    train, evals = ensure_task_data(cache)
    assert (train.parent.name, train.name, evals.name) == (f"copy{NUM_DIGITS}", "train.jsonl", "eval.jsonl")
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    held = [json.loads(line) for line in evals.read_text().splitlines()]
    assert all(r["prompt"] == r["label"] + "=" and len(r["label"]) == NUM_DIGITS for r in rows + held)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held}  # held out
    before = train.stat().st_mtime_ns
    ensure_task_data(cache)
    assert train.stat().st_mtime_ns == before  # written once


def test_prepare_fills_the_flags_and_the_run_config(cache, tmp_path):
    args = parse_train_flags(["--train-backend", "fsdp"])
    run = RunConfig.from_args(args)
    filled = prepare_embedded(args, run)
    model = str(ensure_tiny_model(cache))
    train, evals = map(str, ensure_task_data(cache))
    assert (args.hf_checkpoint, args.prompt_data, args.eval_prompt_data) == (model, train, evals)
    assert filled.train.model.hf_checkpoint == model
    assert (filled.rollout.prompt_data, filled.rollout.eval_prompt_data) == (train, evals)
    assert run.rollout.prompt_data is None  # the run config given is left as it was: a copy is returned
    args = parse_train_flags(["--train-backend", "fsdp"])
    args.hf_checkpoint = str(tmp_path / "given")  # a --hf-checkpoint of the embedded family, given by the user
    assert prepare_embedded(args) is None and args.hf_checkpoint == str(tmp_path / "given")
