"""``--use-opd`` checks before Ray starts (``file_contents.check_file_contents``: the trainer's
preflight and the flag checker): the teacher exists, it shares the student's tokenizer
(the teacher scores the student's token ids, so one id must mean one string in both), and a
``megatron``-type teacher on the Megatron backend has the student's architecture (it is built
with the student's bridge and layout; another size needs ``--opd-type hf`` / ``vllm`` or FSDP)."""

from __future__ import annotations

import json
from pathlib import Path

from rl_plugin.errors import fail

# the config fields a Megatron-built teacher must share with the student (its bridge builds both)
SAME_ARCHITECTURE = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def _vocabulary(path: str):
    """What a token id means under the checkpoint's tokenizer: the char tokenizer's alphabet, or
    the HF tokenizer's vocabulary (token -> id) and special ids."""
    from rl_plugin.rollout.data.tokenizer import CharTokenizer, load_tokenizer

    tok = load_tokenizer(path)
    if isinstance(tok, CharTokenizer):
        return ("char", tok.alphabet)
    t = tok.tok
    return ("hf", tuple(sorted(t.get_vocab().items())), t.eos_token_id, t.bos_token_id)


def check_opd(run) -> None:
    """Refuse (``RLArgumentError``) a teacher directory that is no HF model (a PEFT adapter
    directory, a LoRA run's ``--save-hf`` output, is named as such), another tokenizer than the
    student's, or another architecture for a Megatron-built teacher. The tokenizer and
    architecture need the student's directory: skipped while it is not built yet (the flag
    checker on the embedded model; the trainer builds it before its preflight). ``run``: the
    ``RunConfig``."""
    loss = run.train.loss
    if not loss.use_opd:
        return
    student, teacher = run.train.model.hf_checkpoint, loss.opd_teacher_load
    if not Path(teacher, "config.json").is_file():
        if Path(teacher, "adapter_config.json").is_file():
            fail(
                f"--opd-teacher-load {teacher}",
                "a PEFT adapter directory (adapter_config.json: the --save-hf output of a LoRA run), not a whole "
                "model; the teacher is loaded as a Hugging Face model",
                "pass the merged model instead: the teacher run's --save-hf-merged DIR (with --lora-rank, it writes "
                "W + (alpha/r) B A as a Hugging Face directory)",
            )
        fail(
            f"--opd-teacher-load {teacher}",
            "no Hugging Face checkpoint there (config.json missing)",
            "pass the teacher's Hugging Face directory (e.g. the --save-hf output of its run)",
        )
    if student is None:
        return
    try:
        same = _vocabulary(student) == _vocabulary(teacher)
    except ValueError as exc:  # no tokenizer files
        fail(
            f"--opd-teacher-load {teacher}",
            f"its tokenizer cannot be read ({exc})",
            "use a teacher checkpoint with its tokenizer files",
        )
    if not same:
        fail(
            f"--use-opd: the student --hf-checkpoint {student} and the teacher --opd-teacher-load {teacher}",
            "have different tokenizers; the teacher scores the student's token ids, so every id must mean the same "
            "token to both",
            "distill from a teacher of the student's tokenizer family",
        )
    if loss.opd_type == "megatron" and run.train.train_backend == "megatron":
        s = json.loads(Path(student, "config.json").read_text())
        t = json.loads(Path(teacher, "config.json").read_text())
        diff = [k for k in SAME_ARCHITECTURE if s.get(k) != t.get(k)]
        if diff:
            fail(
                f"--opd-type megatron --train-backend megatron with --opd-teacher-load {teacher}",
                f"the teacher's architecture differs from the student's ({', '.join(f'{k} {t.get(k)} vs {s.get(k)}' for k in diff)}); "
                "the in-trainer teacher is built with the student's Megatron bridge",
                "use --opd-type hf (or vllm) for a teacher of another size, or --train-backend fsdp",
            )
