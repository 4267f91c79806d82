"""Issue 35, on-policy distillation through the real loop (``--use-opd``) on the embedded task, with
a multi-turn custom generate hook (tool ids masked), TIS and (FSDP) the overlapped loop:

- the engine-served teacher (``--opd-type hf``, FSDP) and the in-trainer one (``--opd-type
  megatron``, Megatron) score the same first rollout with the same teacher log-probs
  (``opd/teacher_logprob_mean``, rel 1e-5) and report the same ``opd/reverse_kl``;
- a teacher with another tokenizer is refused before Ray starts, naming both checkpoints.
"""

import json
import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from rl_plugin.loop.embedded_setup import ensure_tiny_model  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402

HOOKS = Path(__file__).resolve().parents[2] / "support" / "turn_hooks.py"
FLAGS = [
    "--custom-generate-function-path",
    f"{HOOKS}:two_turn",
    "--custom-rm-path",
    f"{HOOKS}:first_digit_reward",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--num-rollout",
    "2",
    "--eval-interval",
    "100",
    "--use-tis",
    "--use-opd",
    "--no-progress-bar",
]


def perturbed_copy(src: Path, dst: Path, seed: int = 1) -> Path:
    """The student's checkpoint with every weight moved by N(0, 0.05^2): a teacher with the same
    tokenizer and architecture whose log-probs differ."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(dst / "model.safetensors"))
    save_file(
        {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sd.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with local_ray_cluster(cache):
        student = ensure_tiny_model(cache)
        yield student, perturbed_copy(student, tmp_path_factory.mktemp("t") / "teacher")


def _first_row(d):
    return next(json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x)


def test_engine_and_in_trainer_teachers_agree_in_the_loop(setup, tmp_path):
    _, teacher = setup
    rows = {}
    # FSDP runs the overlapped loop (rollout 1 generated while rollout 0 trains): its first step is still
    # on rollout 0, sampled by the initial weights, as the synchronous Megatron run's
    for backend, kind, loop in (("fsdp", "hf", ["--max-weight-staleness", "1"]), ("megatron", "megatron", [])):
        d = tmp_path / kind
        argv = ["--train-backend", backend, "--opd-type", kind, "--opd-teacher-load", str(teacher), *loop]
        assert main([*argv, "--output-dir", str(d), *FLAGS]) == 0
        rows[kind] = _first_row(d)
    hf, mg = rows["hf"], rows["megatron"]
    assert hf["reward_mean"] == mg["reward_mean"]  # the same rollout (same seed, same engine)
    assert hf["opd/teacher_logprob_mean"] == pytest.approx(mg["opd/teacher_logprob_mean"], rel=1e-5)
    assert hf["opd/reverse_kl"] == pytest.approx(mg["opd/reverse_kl"], rel=1e-4, abs=1e-6)
    assert abs(hf["opd/reverse_kl"]) > 1e-3 and "tis/weight_mean" in hf  # a different teacher; TIS on


def test_teacher_with_another_tokenizer_is_refused(setup, tmp_path, capsys):
    student, teacher = setup
    other = Path(shutil.copytree(teacher, tmp_path / "other_tok"))
    tok = json.loads((other / "char_tokenizer.json").read_text())
    tok["alphabet"] = tok["alphabet"][::-1]  # the same ids, other characters
    (other / "char_tokenizer.json").write_text(json.dumps(tok))
    code = main(["--use-opd", "--opd-teacher-load", str(other), "--output-dir", str(tmp_path / "o"), *FLAGS[:4]])
    err = capsys.readouterr().err
    assert code == 2
    assert f"the student --hf-checkpoint {student} and the teacher --opd-teacher-load {other}" in err
    assert "different tokenizers" in err and "Fix:" in err
