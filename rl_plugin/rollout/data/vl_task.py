"""The embedded vision-language task: name the colour of a solid image; the text never tells.

Every record has the same text prompt (``PROMPT``, a chat turn with one ``<image>``) and one
image: a solid square of one of ``len(colours)`` colours (``COLOURS``, 2 by default), jittered per
record (each channel +-``JITTER``) and of a random size (so no two images are the same bytes, and
the processor's resize varies the image tokens); the label is ``"k/K"``: the colour's index and
the number of colours (so the reward reads nothing but the sample). The
answer is the first response token's class,

    class(token) = token_id mod K,        r = [class(first response token) == k]   in {0, 1}

(K colours: every token answers, so a random policy scores ~1/K from the first rollout and a
signal exists without any pretraining). Only the image tells the label apart, so a policy above
1/K proves the pixels reach both the engine and the trainer. ``colour_reward`` is slime's
``async def rm(args, sample)`` form and refuses a sample without its image
(``sample.multimodal_inputs``): it checks that the reward receives the images too.

``write_colour_task(dir)`` writes ``images/*.png``, ``train.jsonl`` and ``eval.jsonl`` (image paths
relative to the file; eval images from another seed) for ``--multimodal-keys '{"image": "images"}'``;
``python -m rl_plugin.rollout.data.vl_task DIR [NUM_COLOURS]`` does it from the shell
(``examples/vl_colours_cpu.sh``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import List, Tuple

PROMPT = "<image>Which colour is this image?"
COLOURS: Tuple[Tuple[str, Tuple[int, int, int]], ...] = (
    ("red", (220, 30, 30)),
    ("blue", (30, 30, 220)),
    ("green", (30, 200, 30)),
    ("yellow", (230, 220, 40)),
)
JITTER = 20


def colour_records(directory: Path, split: str, num: int, num_colours: int, seed: int) -> List[dict]:
    """``num`` records of ``split`` with their PNGs written under ``directory/images``."""
    from PIL import Image

    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(num):
        k = rng.randrange(num_colours)
        rgb = tuple(min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[k][1])
        side = rng.choice((48, 56, 64, 80))
        name = f"images/{split}_{i:05d}.png"
        Image.new("RGB", (side, side), rgb).save(directory / name)
        out.append({"prompt": PROMPT, "images": [name], "label": f"{k}/{num_colours}"})
    return out


def write_colour_task(directory, *, num_train: int = 256, num_eval: int = 32, num_colours: int = 2, seed: int = 0):
    """Write the task's images and ``train.jsonl`` / ``eval.jsonl``; returns the two paths."""
    if not 2 <= num_colours <= len(COLOURS):
        raise ValueError(f"num_colours must be in [2, {len(COLOURS)}], got {num_colours}")
    directory = Path(directory)
    paths = directory / "train.jsonl", directory / "eval.jsonl"
    for path, split, num, s in zip(paths, ("train", "eval"), (num_train, num_eval), (seed, seed + 1)):
        recs = colour_records(directory, split, num, num_colours, s)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return paths


def write_colour_sft_task(directory, *, num_train: int = 256, num_eval: int = 32, num_colours: int = 2, seed: int = 0):
    """The task for SFT (``--loss-type sft_loss``): the same records with the colour's name as the
    label, i.e. the assistant's answer (``"red"``); returns the two paths."""
    paths = write_colour_task(directory, num_train=num_train, num_eval=num_eval, num_colours=num_colours, seed=seed)
    for path in paths:
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for r in recs:
            r["label"] = COLOURS[int(r["label"].split("/")[0])][0]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return paths


def answer_class(token_id: int, num_colours: int) -> int:
    """The colour a response token names: ``token_id mod K``."""
    return int(token_id) % num_colours


async def colour_reward(args, sample) -> float:
    """1.0 when the first response token names the label's colour (module docstring), else 0.0.
    The label is ``"k/K"``: the colour's index k of K colours."""
    images = (sample.multimodal_inputs or {}).get("image")
    if not images:
        raise ValueError(f"colour_reward: sample {sample.index} reached the reward without its image")
    if sample.response_length == 0:
        return 0.0
    first = sample.tokens[len(sample.tokens) - sample.response_length]
    label, num_colours = (int(x) for x in str(sample.label).split("/"))
    return float(answer_class(first, num_colours) == label)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m rl_plugin.rollout.data.vl_task DIR [NUM_COLOURS]")
    colours = int(sys.argv[2]) if len(sys.argv) == 3 else 2
    print(*write_colour_task(sys.argv[1], num_colours=colours), sep="\n")
