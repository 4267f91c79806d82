"""Issue 44 item 25 (and 24's OPD message): the flag checker (``python -m rl_plugin.arguments``)
refuses the bad files the trainer refuses, with the same one-line message, and the trainer refuses
them before Ray starts: one function, ``rl_plugin.arguments.file_contents.check_file_contents``.

Before: the checker exited 0 on a bad SFT file, a PEFT adapter directory as the OPD teacher and a
LoRA checkpoint resumed with another rank; the trainer refused the last one inside a train rank,
after Ray and the model had started.

"Before Ray starts" is seen, not timed: the trainer runs with ``RAY_ADDRESS=not-an-address``, which
``init_ray`` refuses at once naming ``RAY_ADDRESS``; a trainer that reached Ray would print that,
one that refused first prints the file's message.
"""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments.__main__ import main as checker
from rl_plugin.train import main as trainer
from tests.fast.rollout.data.test_tokenizer import _write_chat_data
from tests.support.real_tokenizer import smollm2_tokenizer_path

CHAT = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and template (1,024 positions)."""
    from rl_plugin.models.smollm2 import tiny_chat_checkpoint

    tok = smollm2_tokenizer_path()
    return str(tiny_chat_checkpoint(tmp_path_factory.mktemp("chat_model"), tok.parent))


def _sft_flags(model, data, out, *extra):
    return [
        "--train-backend",
        "fsdp",
        "--loss-type",
        "sft_loss",
        "--hf-checkpoint",
        model,
        "--prompt-data",
        str(data),
        "--input-key",
        "messages",
        "--apply-chat-template",
        "--rollout-batch-size",
        "2",
        "--num-rollout",
        "4",
        "--output-dir",
        str(out),
        "--no-progress-bar",
        *extra,
    ]


def _same_refusal(capsys, monkeypatch, flags) -> str:
    """The checker's and the trainer's exit codes and error lines; the trainer never reached Ray."""
    rc = checker(list(flags))
    checked = capsys.readouterr().err.strip()
    assert rc == 2, checked
    monkeypatch.setenv("RAY_ADDRESS", "not-an-address")  # init_ray would refuse it at once, naming it
    rc = trainer(list(flags))
    trained = capsys.readouterr().err.strip()
    assert "RAY_ADDRESS" not in trained, trained  # refused before Ray
    assert rc == 2 and trained.splitlines()[-1] == checked, (checked, trained)
    assert checked.startswith("error: ") and "\n" not in checked
    return checked


def test_a_bad_sft_file(capsys, monkeypatch, chat_model, tmp_path):
    data = _write_chat_data(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": CHAT[:1]}])
    msg = _same_refusal(capsys, monkeypatch, _sft_flags(chat_model, data, tmp_path / "o"))
    assert f"--loss-type sft_loss --prompt-data: {data}:2: the conversation has no assistant turn" in msg


def test_an_sft_conversation_longer_than_the_context(capsys, monkeypatch, chat_model, tmp_path):
    """Item 21 through both: before, the checks passed, Ray started and no step finished (110 s)."""
    long_chat = [CHAT[0], {"role": "assistant", "content": "word " * 1100}]
    data = _write_chat_data(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": long_chat}])
    msg = _same_refusal(capsys, monkeypatch, _sft_flags(chat_model, data, tmp_path / "o"))
    assert f"--loss-type sft_loss --prompt-data {data}:2: the conversation is " in msg
    assert f"more than the 1024 positions of the model (max_position_embeddings of --hf-checkpoint {chat_model})" in msg


def test_a_peft_directory_as_the_opd_teacher(capsys, monkeypatch, tmp_path):
    """Item 24: before, the trainer said "pass the teacher's Hugging Face directory (e.g. the --save-hf
    output of its run)", which is what a LoRA run's user had passed; the checker said nothing."""
    import torch

    from rl_plugin.lora.peft_dir import write_peft_dir

    peft = tmp_path / "teacher_adapters"
    write_peft_dir(
        str(peft), {"m.q_proj.lora_A.weight": torch.zeros(8, 4)}, rank=8, alpha=16, dropout=0, targets=["q_proj"]
    )
    flags = [
        "--train-backend",
        "fsdp",
        "--use-opd",
        "--opd-teacher-load",
        str(peft),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    msg = _same_refusal(capsys, monkeypatch, flags)
    assert f"--opd-teacher-load {peft}: a PEFT adapter directory" in msg
    assert "pass the merged model instead: the teacher run's --save-hf-merged DIR" in msg


def test_a_lora_checkpoint_resumed_with_another_rank(capsys, monkeypatch, chat_model, tmp_path):
    """The ranks' own check (``checkpoint.lora_meta.check_lora_meta``), run before Ray: before, the
    trainer refused it inside train rank 0 at load, after Ray and the model had started."""
    from rl_plugin.arguments.embedded import parse_train_flags
    from rl_plugin.checkpoint.layout import step_dir
    from rl_plugin.checkpoint.lora_meta import lora_meta, write_lora_meta
    from rl_plugin.checkpoint.run_settings import settings_of
    from rl_plugin.configs.run import RunConfig
    from rl_plugin.loop.config import LoopConfig
    from rl_plugin.loop.resume import Progress, save_checkpoint

    class NoFilesGroup:  # the driver's part of a save; the ranks' files are not what this reads
        world_size, info = 1, [{"ip": "127.0.0.1"}]

        def save(self, path, step, extra):
            return [[]]

    data = _write_chat_data(tmp_path / "d.jsonl", [{"messages": CHAT}] * 2)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = parse_train_flags(_sft_flags(chat_model, data, tmp_path / "o", "--save", str(ckpt), "--lora-rank", "8"))
    run = RunConfig.from_args(first, load_user_code=False)
    save_checkpoint(LoopConfig.of(run, run_settings=settings_of(run)), NoFilesGroup(), Progress(step=2), 1, {}, None)
    write_lora_meta(str(step_dir(str(ckpt), 2)), lora_meta(run.train.lora, chat_model))

    msg = _same_refusal(
        capsys, monkeypatch, _sft_flags(chat_model, data, tmp_path / "o", "--load", str(ckpt), "--lora-rank", "4")
    )
    assert f"--load {step_dir(str(ckpt), 2)}: its LoRA adapters were trained with other settings" in msg
    assert "--lora-rank 8 in the checkpoint, 4 in this run" in msg
    # the same checkpoint with the same flags passes both (its base is this --hf-checkpoint)
    same = _sft_flags(chat_model, data, tmp_path / "o", "--load", str(ckpt), "--lora-rank", "8")
    assert checker(same) == 0, capsys.readouterr().err
    # a full-model run on it is refused on LoRA-ness alone
    rc = checker(_sft_flags(chat_model, data, tmp_path / "o", "--load", str(ckpt)))
    assert rc == 2 and "a LoRA checkpoint (adapters only), this run trains the whole model" in capsys.readouterr().err


def test_the_checker_still_checks_flags_alone_with_no_file_checks(capsys, tmp_path):
    data = _write_chat_data(tmp_path / "d.jsonl", [{"messages": CHAT[:1]}])
    flags = _sft_flags(str(tmp_path / "absent_model"), data, tmp_path / "o", "--no-file-checks")
    assert checker(flags) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["loss_type"] == "sft_loss"
