"""A multi-turn, tool-using task: the model calls a calculator, reads its answer, then answers.

One sample is three turns, built by the custom generate hook ``generate`` (slime's signature,
``--custom-generate-function-path examples/calculator_tool.py:generate``):

1. the model writes a tagged expression, e.g. ``[3+4]`` (char model) or ``<calc>3+4</calc>``
   (a real tokenizer); generation stops at the closing tag (an id for the char model; for a BPE
   tokenizer the output ids are cut after the first token whose text completes the tag);
2. the hook evaluates it safely (``safe_eval``: integers, + - * and parentheses, through ``ast``,
   nothing else) and appends the result as a tool turn, ``=7=`` (char model) or
   ``<result>7</result>``: ids of the run's tokenizer with loss mask 0 and log-prob 0.0;
3. the model writes its answer and stops (EOS).

Turn 1 without a well-formed call is the answer itself (one turn). ``sample.tokens`` holds
exactly the ids generated and appended (token in, token out); ``metadata["turns"]`` and
``metadata["tool_calls"]`` feed the ``multi_turn/*`` metrics.

``reward(prompt, response, label)`` (``--custom-rm-path examples/calculator_tool.py:reward``)
re-derives the parts from the response text with the hook's own rules, shaped so a tiny model
has a gradient at every stage (make a call, call the right expression, use the result):

    0.1  a well-formed call that evaluates to v
    + 0.3 * max(0, 1 - |v - label| / 10)       (the call's value, graded by distance)
    + 0.2  the answer repeats the tool's value v
    + 0.4  the answer equals the label         (without a call: only this part)

(with the real model's tags the answer is the last integer of the text after the tool turn).
so a model that answers right without the tool gets 0.4 and one that uses it well 1.0.

``python examples/calculator_tool.py prepare OUT [--model tiny|smollm2]`` writes ``train.jsonl``
/ ``eval.jsonl`` (``{"prompt": "3+4", "label": "7"}``; chat messages asking for the tag for
smollm2) and, for ``tiny``, a seeded tiny Qwen2 checkpoint with a character tokenizer over
``ALPHABET`` (``OUT/model``). ``examples/calculator_tool_cpu.sh`` runs it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import operator
import random
import re
from pathlib import Path

from rl_plugin.rollout import Sample, generate_tokens

ALPHABET = "0123456789+-*()[]"  # the char model's characters; "=" is its <sep> id
CHAR_TAGS = ("[", "]", "=", "=")  # call open / close, result open / close
TEXT_TAGS = ("<calc>", "</calc>", "<result>", "</result>")
# the reward's parts (module docstring)
VALID_CALL, VALUE_CLOSE, ANSWER_COPIES, ANSWER_RIGHT, CLOSENESS_SCALE = 0.1, 0.3, 0.2, 0.4, 10.0
CALL_BUDGET, ANSWER_BUDGET = 8, 4  # max new tokens of the call turn and of the answer turn (char model)
SYSTEM = (
    "You can use a calculator: write <calc>EXPRESSION</calc> and you will get <result>VALUE</result>. "
    "Then reply with the number only."
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_EXPR_CHARS, MAX_ABS = 40, 10**12


def safe_eval(expr: str):
    """The integer value of ``expr`` (integers, + - * and parentheses only), or None."""
    if not expr or len(expr) > MAX_EXPR_CHARS:
        return None
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            out = _OPS[type(node.op)](left, right)
            if abs(out) > MAX_ABS:
                raise ValueError("too large")
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return value(tree)
    except ValueError:
        return None


def tags_for(tokenizer):
    return CHAR_TAGS if hasattr(tokenizer, "alphabet") else TEXT_TAGS


def parse_call(text: str, tags):
    """``(call text, expression)`` when ``text`` starts with a well-formed call, else None."""
    m = re.match(re.escape(tags[0]) + r"(.*?)" + re.escape(tags[1]), text.lstrip(), flags=re.S)
    return (m.group(0), m.group(1).strip()) if m else None


def tool_text(value, tags) -> str:
    """The tool turn's text: the value between the result tags ("-" / "error" for a bad expression)."""
    bad = "-" if tags is CHAR_TAGS else "error"
    return f"{tags[2]}{bad if value is None else value}{tags[3]}"


def split_response(text: str, tags):
    """``(call value or None, made a call, answer)`` of a response, with the hook's rules."""
    call = parse_call(text, tags)
    if call is None:
        return None, False, text.strip()
    value = safe_eval(call[1])
    rest = text.lstrip()[len(call[0]) :]
    result = tool_text(value, tags)
    if not rest.startswith(result):  # the text does not carry the tool turn the hook appends
        return value, True, ""
    return value, True, rest[len(result) :].strip()


def reward(prompt, response, label) -> float:
    """The module docstring's reward; ``response`` is the whole response text (tool turn included)."""
    tags = TEXT_TAGS if "<calc>" in str(prompt) + response else CHAR_TAGS  # the real model's prompt names the tag
    value, called, answer = split_response(response, tags)
    if tags is TEXT_TAGS:  # a real model answers in words: its last integer is the answer
        numbers = re.findall(r"-?\d+", answer)
        answer = numbers[-1] if numbers else ""
    right = answer == str(label)
    if not called or value is None:
        return ANSWER_RIGHT if right else 0.0
    closeness = max(0.0, 1.0 - abs(value - int(label)) / CLOSENESS_SCALE)
    return (
        VALID_CALL
        + VALUE_CLOSE * closeness
        + (ANSWER_COPIES if answer == str(value) else 0.0)
        + (ANSWER_RIGHT if right else 0.0)
    )


@functools.lru_cache(maxsize=4)
def _tokenizer(checkpoint: str):
    from rl_plugin.rollout.data.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint)


def _encode(tokenizer, text: str):
    return (
        tokenizer.encode(text)
        if hasattr(tokenizer, "alphabet")
        else tokenizer.tok.encode(text, add_special_tokens=False)
    )


def _cut_after(tokenizer, ids, text: str):
    """The shortest prefix of ``ids`` whose decoded text contains ``text`` (None: none does)."""
    for k in range(1, len(ids) + 1):
        if text in tokenizer.tok.decode(ids[:k]):
            return k
    return None


async def generate(args, sample: Sample, sampling_params) -> Sample:
    """The three-turn hook (module docstring)."""
    tok = _tokenizer(args.hf_checkpoint)
    tags = tags_for(tok)
    char = tags is CHAR_TAGS
    call_params = dict(sampling_params)
    if char:
        call_params.update(max_new_tokens=CALL_BUDGET, stop_token_ids=_encode(tok, tags[1]))
    out = await generate_tokens(args, sample.tokens, call_params)
    ids, lps, finish = out["output_ids"], out["output_log_probs"], out["finish_reason"]
    call = parse_call(tok.decode(ids), tags)
    if call is not None and not char:  # cut the BPE output after the closing tag (token in, token out)
        k = _cut_after(tok, ids, tags[1])
        ids, lps, finish = ids[:k], lps[:k], "stop"
    mask = [1] * len(ids)
    turns, calls = 1, 0
    if call is not None and finish == "stop":
        tool = _encode(tok, tool_text(safe_eval(call[1]), tags))
        answer_params = dict(sampling_params)
        if char:
            answer_params.update(max_new_tokens=ANSWER_BUDGET)
        answer = await generate_tokens(args, sample.tokens + ids + tool, answer_params)
        ids = ids + tool + answer["output_ids"]
        lps = lps + [0.0] * len(tool) + answer["output_log_probs"]
        mask = mask + [0] * len(tool) + [1] * len(answer["output_ids"])
        finish, turns, calls = answer["finish_reason"], 2, 1
    sample.tokens = sample.tokens + ids
    sample.response_length = len(ids)
    sample.loss_mask, sample.rollout_log_probs = mask, lps
    sample.response = tok.decode(ids)
    sample.status = Sample.Status.COMPLETED if finish == "stop" else Sample.Status.TRUNCATED
    sample.metadata.update(turns=turns, tool_calls=calls)
    return sample


# -- data and model ------------------------------------------------------------------------------
def make_tiny_model(directory: Path) -> Path:
    """A seeded tiny Qwen2 (the embedded model's shape) with a character tokenizer over ``ALPHABET``."""
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint
    from rl_plugin.rollout.data.tokenizer import CharTokenizer

    tok = CharTokenizer(ALPHABET)
    make_tiny_hf_checkpoint(
        directory,
        "qwen2",
        seed=0,
        vocab_size=tok.vocab_size,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    tok.save(directory)
    return directory


def records(pairs, model: str):
    if model == "tiny":
        return [{"prompt": f"{a}+{b}", "label": str(a + b)} for a, b in pairs]
    return [
        {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
            "label": str(a + b),
        }
        for a, b in pairs
    ]


def prepare(out: Path, model: str, max_operand: int, seed: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    held = pairs[:16]
    train = (pairs[16:] * 20)[:2000]
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(train, model)))
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(held, model)))
    if model == "tiny":
        make_tiny_model(out / "model")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="write the data (and the tiny model) under OUT")
    prep.add_argument("out", type=Path)
    prep.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    prep.add_argument("--max-operand", type=int, default=9)
    a = p.parse_args(argv)
    prepare(a.out, a.model, a.max_operand)
    print(a.out)


if __name__ == "__main__":
    main()
