"""The ``--use-opd`` teacher checks (``rl_plugin.arguments.opd_teacher.check_opd``): no HF model
there (a PEFT adapter directory named as such), another tokenizer than the student's, another
architecture for a Megatron-built teacher; each refusal names the flag, the rule and the fix."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.arguments.opd_teacher import SAME_ARCHITECTURE, check_opd
from rl_plugin.configs.run import RunConfig
from rl_plugin.rollout.data.tokenizer import CharTokenizer

ARCH = {
    "model_type": "llama",
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "vocab_size": 40,
    "tie_word_embeddings": True,
}


def _model(path, alphabet="0123456789+=", **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**ARCH, **config}))
    CharTokenizer(alphabet).save(path)
    return str(path)


def _run(student, teacher, opd_type="megatron"):
    run = RunConfig.from_args(parse_args(["--train-backend", "megatron"]), load_user_code=False)
    loss = replace(run.train.loss, use_opd=True, opd_teacher_load=teacher, opd_type=opd_type)
    model = replace(run.train.model, hf_checkpoint=student)
    return replace(run, train=replace(run.train, loss=loss, model=model))


def _refused(run, *fragments):
    with pytest.raises(RLArgumentError) as err:
        check_opd(run)
    message = str(err.value)
    assert "Fix:" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_without_use_opd_nothing_is_checked(tmp_path):
    run = RunConfig.from_args(parse_args([]), load_user_code=False)
    assert run.train.loss.use_opd is False
    check_opd(run)


def test_teacher_without_config_json(tmp_path):
    (tmp_path / "t").mkdir()
    _refused(
        _run(None, str(tmp_path / "t")),
        f"--opd-teacher-load {tmp_path / 't'}: no Hugging Face checkpoint there (config.json missing)",
    )


def test_peft_adapter_directory_is_named(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    _refused(_run(None, str(tmp_path / "adapter")), "a PEFT adapter directory", "--save-hf-merged DIR")


def test_student_not_built_yet_skips_the_tokenizer_and_architecture(tmp_path):
    check_opd(_run(None, _model(tmp_path / "t", alphabet="abc", hidden_size=999)))


def test_same_tokenizer_and_architecture_pass(tmp_path):
    check_opd(_run(_model(tmp_path / "s"), _model(tmp_path / "t")))


def test_another_tokenizer_is_refused(tmp_path):
    student, teacher = _model(tmp_path / "s"), _model(tmp_path / "t", alphabet="0123456789+-")
    _refused(
        _run(student, teacher),
        f"--use-opd: the student --hf-checkpoint {student} and the teacher --opd-teacher-load {teacher}",
        "have different tokenizers",
    )


def test_teacher_without_tokenizer_files(tmp_path):
    student = _model(tmp_path / "s")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(ARCH))
    _refused(_run(student, str(tmp_path / "t")), "its tokenizer cannot be read", "with its tokenizer files")


def test_megatron_teacher_of_another_architecture(tmp_path):
    student, teacher = _model(tmp_path / "s"), _model(tmp_path / "t", hidden_size=32, num_hidden_layers=4)
    _refused(
        _run(student, teacher, "megatron"),
        f"--opd-type megatron --train-backend megatron with --opd-teacher-load {teacher}",
        "(hidden_size 32 vs 16, num_hidden_layers 4 vs 2)",
        "use --opd-type hf (or vllm)",
    )


def test_hf_teacher_may_have_another_architecture(tmp_path):
    student, teacher = _model(tmp_path / "s"), _model(tmp_path / "t", hidden_size=32)
    check_opd(_run(student, teacher, "hf"))


def test_the_architecture_fields():
    assert set(SAME_ARCHITECTURE) == set(ARCH)
