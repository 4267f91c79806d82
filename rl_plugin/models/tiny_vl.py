"""A tiny random Qwen2.5-VL checkpoint, built locally (no download): model, processor, tokenizer,
chat template.

``python -m rl_plugin.models.tiny_vl OUT`` writes a directory that
``AutoModelForImageTextToText`` and ``AutoProcessor`` load: a ``Qwen2_5_VLForConditionalGeneration``
with a 2-block vision tower (patch 14, 2x2 spatial merge, window attention in block 0, full
attention in block 1) and a 2-layer text model (head_dim 32, so vLLM's CPU attention runs it; M-RoPE
sections 4/6/6 = head_dim / 2), a ``Qwen2VLImageProcessor`` with small ``min_pixels`` /
``max_pixels`` (an image becomes 4..16 image tokens), and a byte-level tokenizer.

The tokenizer is the embedded text model's idea (``rollout.data.tokenizer.CharTokenizer``: one
id per character, no vocabulary to download) in Hugging Face form: a byte-level BPE with no
merges (ids 0..255 are the 256 bytes, so any text encodes), then Qwen's special tokens
(``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>``, ``<|video_pad|>``). The chat template is ChatML with image content parts
rendered as ``<|vision_start|><|image_pad|><|vision_end|>``; the processor expands each
``<|image_pad|>`` into the image's ``prod(grid_thw) / merge**2`` tokens. Weights are drawn from a
seeded generator: the same arguments give bit-identical checkpoints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
NUM_BYTES = 256
PAD_ID, BOS_ID, EOS_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2  # endoftext, im_start, im_end
VISION_START_ID, VISION_END_ID, IMAGE_ID, VIDEO_ID = (NUM_BYTES + i for i in range(3, 7))
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS) + 1  # 264: one spare id keeps the vocabulary even
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = (PATCH * MERGE) ** 2 * 4, (PATCH * MERGE) ** 2 * 16  # 56x56 .. 112x112

# ChatML; an image content part is the vision block the processor expands (``{"type": "image"}``,
# with or without the image itself in the part), a text part its text, a plain string content itself.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vl_config(*, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 1):
    """The ``Qwen2_5_VLConfig``: text head_dim = ``hidden_size // num_heads`` (32 by default) with
    M-RoPE sections summing to head_dim / 2; vision hidden 64 in 2 heads, out to ``hidden_size``."""
    from transformers import Qwen2_5_VLConfig

    head_dim = hidden_size // num_heads
    if head_dim % 8:
        raise ValueError(f"tiny_vl: head_dim {head_dim} must be a multiple of 8 (M-RoPE sections)")
    half = head_dim // 2
    section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]  # 4/6/6 at head_dim 32
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        window_size=PATCH * MERGE * 2,
        out_hidden_size=hidden_size,
        fullatt_block_indexes=[num_layers - 1],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def tiny_vl_tokenizer():
    """The byte-level tokenizer (module docstring) as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # the alphabet in byte order: GPT-2's byte-to-unicode table maps byte b to one printable char
    ordered = sorted(byte_chars, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(ordered)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``char`` (printable bytes map to themselves,
    the rest to U+0100 upwards in byte order)."""
    code = ord(char)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def save_tiny_vl_processor(path) -> None:
    """Write the processor files ``AutoProcessor`` reads (``processor_config.json`` naming
    ``Qwen2_5_VLProcessor``, the image processor at ``MIN_PIXELS`` .. ``MAX_PIXELS``, the tokenizer,
    ``chat_template.jinja``), without building the processor object: transformers builds its video
    processor with torchvision, which this install may lack (``rl_plugin.models.vl_processor``)."""
    import json

    from transformers import Qwen2VLImageProcessorPil

    path = Path(path)
    tiny_vl_tokenizer().save_pretrained(path)
    Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE
    ).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def make_tiny_vl_checkpoint(path, *, seed: int = 0, **config_kwargs) -> Path:
    """Write the seeded tiny Qwen2.5-VL (model + processor + tokenizer) to ``path``; idempotent
    (an existing checkpoint is left as it is)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    config = tiny_vl_config(**config_kwargs)
    gen = torch.Generator().manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p[0].numel() ** 0.5))
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tiny_vl_processor(tmp)
    tmp.rename(path)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m rl_plugin.models.tiny_vl OUT", file=sys.stderr)
        return 2
    print(make_tiny_vl_checkpoint(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
