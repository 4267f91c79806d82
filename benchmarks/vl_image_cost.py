"""What images cost (issue 46): trainer and engine tokens/s with and without images at the same
token count, on the tiny Qwen2.5-VL checkpoint (``rl_plugin.models.tiny_vl``).

For each image side S (a square image of S x S pixels is ``(S / 28)**2`` image tokens at
``--max-pixels S*S``), ``--samples`` prompts ``"Colour <image> please?"`` (the chat template, one
random-noise image each) with a ``--response-len``-token response. The text-only baseline is the
same token ids with every image token replaced by a text token (``"x"``) and no pixels: the same
sequence lengths on the same checkpoint, so a ratio is the images' own cost (the vision tower, the
embedding scatter, the 3-D positions; a text-only pass still runs the tower once on a blank 2 x 2
patch image, ``backends/fsdp/vision.py``). In one process (one rank, gloo world of 1, one torch
thread as a train rank / engine actor runs), rounds alternate text / image, medians reported:

- trainer: ``FSDPBackend.train_step`` (forward + backward + AdamW, one micro-batch, thd) in
  tokens/s = sum of the samples' lengths / step time;
- vision tower: the tower alone (``model.visual`` forward + backward of the batch's pixels, a plain
  HF model) over the trainer's step time with images: the tower's share of the step;
- engine: ``HFEngine.generate`` of the prompts (``--new-tokens`` new tokens, temperature 1) in
  tokens/s = rows x (prompt + decode steps run) / call time. Images go through ``model.generate``
  (the lean sampler has no multimodal prefill), so the text baseline is forced onto
  ``model.generate`` too; the lean sampler's text time (what a text run uses) is the last column.

    python -m benchmarks.vl_image_cost [--sides 56 112 224 336] [--samples 8] [--rounds 5]

Not a test: numbers depend on the machine and its load (compare only within one run).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

TEXT_ID = ord("x")  # the byte tokenizer's id of "x" (ids below 256 are bytes)


def prompts_of(ckpt, side: int, samples: int):
    """``samples`` image prompts at ``side`` x ``side`` px and their text-only twins (same length)."""
    from PIL import Image

    from rl_plugin.models.tiny_vl import IMAGE_ID
    from rl_plugin.rollout.data.vl_prompt import rollout_prompts
    from tests.support.tiny_vl import vl_rollout_config

    config = vl_rollout_config(apply_chat_template=True, min_pixels=side * side, max_pixels=side * side)
    vl = rollout_prompts(config, ckpt)
    g = torch.Generator().manual_seed(side)
    images = []
    for _ in range(samples):
        noise = torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy()
        images.append(vl.image_prompt("Colour <image> please?", [Image.fromarray(noise)]))
    texts = [[TEXT_ID if t == IMAGE_ID else t for t in p] for p in images]
    return images, texts, sum(t == IMAGE_ID for t in images[0])


def step_batches(images, texts, response_len: int):
    """The trainer's ``StepBatch`` of the image prompts and of their text twins (same responses)."""
    from rl_plugin.loss import StepBatch

    g = torch.Generator().manual_seed(0)
    n = len(images)
    resp = torch.randint(0, 256, (n, response_len), generator=g)
    lengths = torch.tensor([len(p) + response_len for p in images])
    common = dict(
        total_lengths=lengths,
        response_lengths=torch.full((n,), response_len),
        loss_mask=torch.ones(n * response_len),
        advantages=torch.randn(n, generator=g).repeat_interleave(response_len),
        group_ids=torch.arange(n) // 2,
    )
    text_ids = torch.cat([torch.tensor(p + r) for p, r in zip(texts, resp.tolist())])
    image_ids = torch.cat([torch.tensor(list(p) + r) for p, r in zip(images, resp.tolist())])
    text = StepBatch(tokens=text_ids, **common)
    image = StepBatch(
        tokens=image_ids,
        pixel_values=torch.cat([p.pixel_values for p in images]),
        image_grid_thw=torch.cat([p.image_grid_thw for p in images]),
        image_counts=torch.ones(n, dtype=torch.long),
        **common,
    )
    return text.validate(), image.validate()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def vision_pass(model, batch) -> None:
    """The vision tower alone: forward + backward of the batch's pixels."""
    model.zero_grad(set_to_none=True)
    out = model.model.visual(batch.pixel_values, grid_thw=batch.image_grid_thw)
    feats = out if torch.is_tensor(out) else out.pooler_output
    feats.sum().backward()


def worker(rank, world, ckpt, opts):
    from rl_plugin.arguments import parse_args
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.fsdp.model import load_hf_model
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    torch.set_num_threads(1)
    flags = ["--train-backend", "fsdp", "--hf-checkpoint", ckpt, "--lr", "1e-4"]
    flags += ["--micro-batch-size", str(opts.samples), "--qkv-format", "thd"]
    backend = FSDPBackend.from_args(parse_args(flags))
    plain = load_hf_model(ckpt)
    engine = HFEngine(ckpt)
    params = SamplingParams(max_new_tokens=opts.new_tokens)
    rows = []
    for side in opts.sides:
        images, texts, image_tokens = prompts_of(ckpt, side, opts.samples)
        text_b, image_b = step_batches(images, texts, opts.response_len)
        t = {k: [] for k in ("train_text", "train_image", "vision", "gen_text", "gen_image", "gen_lean")}

        def generate(prompts, lean=False):
            engine.lean_blocker = None if lean else "benchmark: model.generate for both"
            return engine.generate(prompts, params, seed=0)

        for i in range(opts.rounds + 1):  # round 0 warms up
            times = {
                "train_text": _timed(lambda: backend.train_step(text_b, num_groups=opts.samples // 2)),
                "train_image": _timed(lambda: backend.train_step(image_b, num_groups=opts.samples // 2)),
                "vision": _timed(lambda: vision_pass(plain, image_b)),
                "gen_text": _timed(lambda: generate(texts)),
                "gen_image": _timed(lambda: generate(images)),
                "gen_lean": _timed(lambda: generate(texts, lean=True)),
            }
            if i:
                for k, v in times.items():
                    t[k].append(v)
        med = {k: statistics.median(v) for k, v in t.items()}
        gen = generate(images)
        gen_tokens = len(images) * (len(images[0]) + max(len(g.response_ids) for g in gen))  # steps run
        rows.append(
            dict(
                side=side,
                sample_len=len(images[0]) + opts.response_len,
                image_tokens=image_tokens,
                train_tokens=int(text_b.total_lengths.sum()),
                gen_tokens=gen_tokens,
                **med,
            )
        )
    return rows


def table(rows, opts) -> str:
    head = (
        f"{opts.samples} samples x (prompt + {opts.response_len} response tokens) per train step; "
        f"engine: {opts.samples} prompts, {opts.new_tokens} new tokens; median of {opts.rounds} rounds\n\n"
        "| image (px) | tokens / sample | image tokens (share) | trainer tok/s text | with images | ratio "
        "| vision tower / step | engine tok/s text (generate) | with images | ratio | text, lean sampler |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        tr_text, tr_img = r["train_tokens"] / r["train_text"], r["train_tokens"] / r["train_image"]
        gen_text, gen_img = r["gen_tokens"] / r["gen_text"], r["gen_tokens"] / r["gen_image"]
        share = r["image_tokens"] / r["sample_len"]
        lines.append(
            f"| {r['side']}x{r['side']} | {r['sample_len']} | {r['image_tokens']} ({share:.0%}) "
            f"| {tr_text:,.0f} | {tr_img:,.0f} | {tr_img / tr_text:.2f}x | {r['vision'] / r['train_image']:.0%} "
            f"| {gen_text:,.0f} | {gen_img:,.0f} | {gen_img / gen_text:.2f}x | {r['gen_tokens'] / r['gen_lean']:,.0f} |"
        )
    return head + "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[56, 112, 224, 336])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args(argv)
    from rl_plugin.models.tiny_vl import make_tiny_vl_checkpoint
    from tests.support.harness import run_world

    ckpt = str(make_tiny_vl_checkpoint(Path(tempfile.mkdtemp()) / "tiny-vl"))
    rows = run_world(worker, 1, ckpt, opts)[0]
    print("\n## Images: what they cost (tiny Qwen2.5-VL, FSDP 1 rank + hf engine, 1 thread)\n")
    print(table(rows, opts))


if __name__ == "__main__":
    main()
