"""Issue 35, the OPD teacher's log-probs: the in-trainer teacher (``--opd-type megatron``, on both
backends, ``compute_log_probs(role="teacher")``) and the engine-served one (``--opd-type hf``,
``rollout.engines.teacher.HFTeacher``: micro-batched forwards of the teacher's HF model) give the
same teacher log-probs of the same sampled tokens, to fp32 rounding; and they are the teacher's
(another model's), not the student's."""

from __future__ import annotations

import pytest

from tests.support.fsdp_common import make_step, step_batch


def _worker(rank, world, backend_name, student, teacher):
    from rl_plugin.arguments import parse_args
    from rl_plugin.ray.train_actor import backend_class

    args = parse_args(
        ["--train-backend", backend_name, "--hf-checkpoint", student, "--use-opd", "--opd-teacher-load", teacher]
    )
    backend = backend_class(backend_name).from_args(args)
    batch = step_batch(make_step(seed=5, with_ref=False))
    return {
        "teacher": backend.compute_log_probs(batch, role="teacher"),
        "student": backend.compute_log_probs(batch, role="actor"),
    }


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_in_trainer_and_engine_teacher_agree(run_world, tiny_checkpoint, backend):
    from rl_plugin.rollout.engines.teacher import HFTeacher

    student, teacher = tiny_checkpoint("qwen2"), tiny_checkpoint("qwen2", seed=1)
    out = run_world(_worker, 1, backend, student, teacher)[0]
    batch = step_batch(make_step(seed=5, with_ref=False))
    engine = HFTeacher(teacher).log_probs(batch.tokens, batch.total_lengths, batch.response_lengths)
    scale = float(engine.abs().max())
    assert engine.shape == out["teacher"].shape == (int(batch.response_lengths.sum()),)
    assert float((out["teacher"] - engine).abs().max()) <= 2e-5 * scale  # fp32 forwards, other kernels
    assert float((out["student"] - engine).abs().max()) > 1e-2  # a different model's numbers
