"""The embedded default's setup: its model and data files, built before the run starts
(``rl-plugin-train --train-backend X`` with no data or model flags; its flag defaults and the
rule that picks it are ``rl_plugin.arguments.embedded``: ``is_embedded`` decides, and a
``--hf-checkpoint`` alone is refused there unless it is of the embedded family).

It builds (once, then reuses) a tiny Qwen2-architecture model with a character tokenizer over
the digits, and the digit-copy task (``rl_plugin.rollout.data.task``) with a held-out eval split,
and fills in rollout/optimizer defaults that make the tiny model learn the task on a 2-core CPU
in minutes (measured by ``benchmarks/embedded_default.py``; the defaults live in
``rl_plugin.arguments.embedded``). Any flag given explicitly wins.

Files go under ``$RL_PLUGIN_CACHE`` (default ``outputs/``): ``tiny_model/<config>/`` (HF
checkpoint + ``char_tokenizer.json``, loaded by both backends and the rollout engine) and
``tiny_task/<task>/{train,eval}.jsonl``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rl_plugin.arguments.embedded import EMBEDDED_TASK_DIGITS, is_embedded  # noqa: F401 - is_embedded: for the run
from rl_plugin.rollout.data.task import DIGITS, write_task_data
from rl_plugin.rollout.data.tokenizer import CharTokenizer

NUM_DIGITS = EMBEDDED_TASK_DIGITS
TASK = "copy"
# head_dim = hidden / heads = 32: the smallest head size vLLM's CPU attention accepts (16 is not).
MODEL = dict(
    family="qwen2",
    vocab_size=16,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
)


def cache_root() -> Path:
    return Path(os.environ.get("RL_PLUGIN_CACHE", "outputs"))


def _model_name(family: str) -> str:
    m = MODEL
    return f"{family}-v{m['vocab_size']}-h{m['hidden_size']}-a{m['num_heads']}-l{m['num_layers']}-seed0"


def ensure_tiny_model(root: Path, family: str = MODEL["family"]) -> Path:
    """The tiny checkpoint + char tokenizer, written atomically once (a temp dir renamed).
    ``family``: another ``rl_plugin.models.tiny`` family at the same sizes, e.g. ``qwen3_moe``
    (4 experts, top-2: the MoE end-to-end runs pass it as ``--hf-checkpoint``)."""
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    target = root / "tiny_model" / _model_name(family)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    cfg = dict(MODEL)
    cfg.pop("family")
    make_tiny_hf_checkpoint(tmp, family, seed=0, **cfg)
    tok = CharTokenizer(DIGITS)
    if tok.vocab_size > MODEL["vocab_size"]:
        raise ValueError(f"char tokenizer needs {tok.vocab_size} ids, the tiny model has {MODEL['vocab_size']}")
    tok.save(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_task_data(root: Path):
    d = root / "tiny_task" / f"{TASK}{NUM_DIGITS}"
    train, evals = d / "train.jsonl", d / "eval.jsonl"
    if not (train.exists() and evals.exists()):
        write_task_data(d, task=TASK, num_digits=NUM_DIGITS, seed=0)
    return train, evals


def prepare_embedded(args, run=None):
    """Build (once) and fill in the model and the data of the embedded run: into ``args`` (the
    flags the user's hooks receive) and, given the ``RunConfig`` ``run``, into a copy of it, which
    is returned. Its output directory's default is the run config's (``RunConfig.output_dir``)."""
    root = cache_root()
    if args.hf_checkpoint is None:
        args.hf_checkpoint = str(ensure_tiny_model(root))
    train, evals = ensure_task_data(root)
    args.prompt_data, args.eval_prompt_data = str(train), str(evals)
    return None if run is None else run.with_model_and_data(args.hf_checkpoint, args.prompt_data, args.eval_prompt_data)
