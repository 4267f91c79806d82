"""Issue 35, SFT through the real loop (``rl-plugin-train --loss-type sft_loss``: Ray actors, DP=2,
micro-batch 2, both backends, no rollout engine) on a tiny random Llama carrying SmolLM2's real
tokenizer and ChatML template:

- the step-1 loss equals the token-mean NLL of the assistant tokens (content + ``<|im_end|>``)
  under the initial model, computed here independently: transformers' forward, the assistant
  tokens found by character offsets in the rendered text (rel 1e-5, fp32);
- the loss falls over a few steps on the same small chat set, and the held-out eval NLL with it;
- the ``--save-hf`` output of the SFT run starts an RL run (``--hf-checkpoint``); without ``--save``
  it is written once, at the end (issue 44 item 6).

Other layouts are not run here: the SFT objective and gradient are layout-invariant in
``tests/fast/parity/test_loss_layouts.py`` (every DP x CP layout, every mode), and Megatron's
TP = 2 and PP = 2 log-probs, steps and forward-only (eval) pass equal TP = 1 / PP = 1 in
``tests/fast/backends/megatron/test_parity.py`` and ``tests/fast/parity/test_pipeline.py``.
"""

import json

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from rl_plugin.models.smollm2 import tiny_chat_checkpoint  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.fast.rollout.data.test_tokenizer import _write_chat_data  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.real_tokenizer import smollm2_tokenizer_path  # noqa: E402

CHATS = [
    [
        {"role": "user", "content": f"What is {i} + {j}?"},
        {"role": "assistant", "content": f"{i + j}"},
    ]
    + (
        [{"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"It is {2 * (i + j)}."}]
        if i % 2
        else []
    )
    for i, j in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (4, 4), (6, 3), (9, 0)]
]
HEADER, END = "<|im_start|>assistant\n", "<|im_end|>"


def independent_token_mean_nll(model_dir, chats) -> float:
    """Token-mean NLL of the assistant content + <|im_end|> tokens, by transformers alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for chat in chats:
        text = tok.apply_chat_template(chat, tokenize=False)
        spans, pos = [], 0
        for m in chat:
            if m["role"] == "assistant":
                at = text.index(HEADER + m["content"] + END, pos) + len(HEADER)
                pos = at + len(m["content"]) + len(END)
                spans.append((at, pos))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        assert ids == list(tok.apply_chat_template(chat, tokenize=True, return_dict=False))
        mask = [any(a <= s and e <= b for a, b in spans) and e > s for s, e in enc["offset_mapping"]]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        for t in range(1, len(ids)):
            if mask[t]:
                nll -= float(logp[t - 1, ids[t]])
                count += 1
    return nll / count


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = smollm2_tokenizer_path()  # fetched before the cluster moves RL_PLUGIN_CACHE
    model = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"), tok.parent)
    data = _write_chat_data(tmp_path_factory.mktemp("data") / "chats.jsonl", [{"messages": c} for c in CHATS])
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield model, data


def _sft(backend, model, data, out, *extra):
    return main(
        [
            "--train-backend",
            backend,
            "--loss-type",
            "sft_loss",
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(data),
            "--eval-prompt-data",
            str(data),
            "--input-key",
            "messages",
            "--apply-chat-template",
            "--rollout-batch-size",
            "8",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--num-rollout",
            "4",
            "--eval-interval",
            "4",
            "--lr",
            "1e-2",
            "--output-dir",
            str(out),
            "--no-progress-bar",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "backend, agg",
    [
        ("megatron", ["--calculate-per-token-loss"]),
        ("fsdp", ["--loss-aggregation", "token_mean"]),
    ],
    ids=["megatron-dp2", "fsdp-dp2"],
)
def test_sft_step1_loss_is_the_independent_nll_and_falls(setup, tmp_path, backend, agg):
    model, data = setup
    want = independent_token_mean_nll(model, CHATS)
    out = tmp_path / "o"
    assert _sft(backend, model, data, out, *agg, "--save", str(out / "ckpt"), "--save-hf", str(out / "hf")) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/nll" in r]
    assert len(steps) == 4 and len(evals) == 1
    assert steps[0]["loss"] == pytest.approx(want, rel=1e-5)  # the independent token-mean NLL
    assert steps[0]["sft/nll"] == pytest.approx(want, rel=1e-5)
    assert steps[0]["sft/ppl"] == pytest.approx(float(torch.tensor(want).exp()), rel=1e-4)
    assert steps[0]["sft/tokens"] == steps[0]["tokens"] > 8  # content + <|im_end|> of 12 assistant turns
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # learned on the set
    assert evals[0]["eval/nll"] < steps[0]["loss"] - 0.5
    # the saved model's NLL is the final eval's (same weights, same tokens)
    assert independent_token_mean_nll(out / "hf", CHATS) == pytest.approx(evals[0]["eval/nll"], rel=1e-4)
    if backend == "fsdp":  # SFT then RL: the --save-hf output starts an RL run
        rm = tmp_path / "rm.py"
        rm.write_text("def reward(prompt, response, label):\n    return float(len(response) > 0)\n")
        rl = tmp_path / "rl"
        prompts = _write_chat_data(tmp_path / "rl.jsonl", [{"messages": c[:1], "label": "x"} for c in CHATS[:2]])
        argv = ["--train-backend", "fsdp", "--hf-checkpoint", str(out / "hf"), "--prompt-data", str(prompts)]
        argv += ["--input-key", "messages", "--apply-chat-template", "--custom-rm-path", f"{rm}:reward"]
        argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3"]
        argv += ["--num-rollout", "1", "--output-dir", str(rl), "--no-progress-bar"]
        assert main(argv) == 0
        assert any('"reward_mean"' in x for x in (rl / "metrics.jsonl").read_text().splitlines())


def test_sft_checkpoint_loads_into_an_rl_run_on_the_embedded_task(setup, tmp_path):
    """The embedded task's records are prompt + label pairs: SFT trains on ``<bos> prompt |
    label <eos>`` (the character tokenizer), and its checkpoint --load-s into the RL run on the same
    file, which continues the step and rollout counters and the data position."""
    ckpt, common = tmp_path / "ckpt", ["--train-backend", "fsdp", "--no-progress-bar", "--save", str(tmp_path / "ckpt")]
    assert main(["--loss-type", "sft_loss", "--num-rollout", "2", "--output-dir", str(tmp_path / "sft"), *common]) == 0
    sft = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert sft[-1]["sft/tokens"] == 16 * 4  # 16 records a batch, 3 digits + <eos> each
    assert main(["--num-rollout", "3", "--load", str(ckpt), "--output-dir", str(tmp_path / "rl"), *common]) == 0
    rl = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]
    assert [(r["rollout_id"], r["step"]) for r in rl] == [(2, 3)]


@pytest.mark.parametrize(
    "backend, agg",
    [("megatron", ["--calculate-per-token-loss"]), ("fsdp", ["--loss-aggregation", "token_mean"])],
    ids=["megatron", "fsdp"],
)
def test_save_hf_without_save_writes_the_final_model(setup, tmp_path, backend, agg):
    """Issue 44 item 6: ``--save-hf DIR`` without ``--save`` writes the final model at the end of the
    run (before: exit 0 and nothing written; an OPD recipe that --opd-teacher-load-ed it failed).
    The directory loads with transformers and holds the trained weights: its NLL is the final eval's."""
    model, data = setup
    out = tmp_path / "o"
    assert _sft(backend, model, data, out, *agg, "--save-hf", str(out / "hf")) == 0
    assert not (out / "ckpt").exists()
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval/nll"' in x]
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    assert independent_token_mean_nll(out / "hf", CHATS) == pytest.approx(evals[-1]["eval/nll"], rel=1e-4)
