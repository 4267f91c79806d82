"""The ``rl_plugin.train`` entry point: the embedded run's argument defaults (only without
``--prompt-data``) and exit status 2 with the rule's message on bad flags."""

from __future__ import annotations

from rl_plugin.train import parse_train_args


def test_embedded_defaults_apply_only_without_prompt_data():
    a = parse_train_args(["--train-backend", "fsdp"])
    assert (a.num_rollout, a.rollout_batch_size, a.lr, a.rm_type) == (300, 16, 3e-3, "digit_match")
    assert parse_train_args(["--lr", "1e-4"]).lr == 1e-4  # an explicit flag wins
    b = parse_train_args(
        [
            "--prompt-data",
            "p.jsonl",
            "--rollout-batch-size",
            "2",
            "--rollout-max-response-len",
            "8",
            "--num-rollout",
            "1",
            "--rm-type",
            "math_exact",
        ]
    )
    assert b.lr == 1e-6 and b.eval_interval is None  # Megatron-LM's defaults, not the embedded ones


def test_train_main_exits_2_on_bad_flags(capsys):
    from rl_plugin.train import main

    assert main(["--colocate", "--rollout-num-gpus", "2"]) == 2
    assert "--colocate with --rollout-num-gpus" in capsys.readouterr().err
