"""vLLM's own LoRA for the ``vllm`` engine (``--lora-rank``): the base stays, adapters are loaded.

vLLM (the CPU build 0.32 too) serves LoRA natively: the engine is built with ``enable_lora``,
``max_loras=1`` and the smallest ``max_lora_rank`` vLLM accepts that holds ``--lora-rank``. A sync
carries adapter tensors only (canonical names); ``VLLMAdapters`` keeps the newest of each and,
before the next generate (or read-back), writes them as a PEFT adapter directory
(``rl_plugin.lora.peft_dir``) and registers it as a NEW ``LoRARequest`` (a new id per sync: vLLM
caches adapters by id), removing the previous one. Every generate then passes that request.
Nothing is merged: the base weights are the checkpoint's for the whole run.

Read-back (``--check-weight-sync`` / ``--check-lora-weight-equal``): the adapter weights the LoRA
layers compute with (their ``lora_a_stacked`` / ``lora_b_stacked`` slot 0, a packed q/k/v or
gate/up layer split by its output slices). vLLM folds the scaling into B when it loads
(``lora_b *= alpha / r``), so B is read back as ``lora_b / (alpha / r)``: bitwise exact when
alpha / r is a power of two (the rule in ``configs.lora`` asks for that under the check).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

import torch

from rl_plugin.lora.peft_dir import write_peft_dir
from rl_plugin.lora.scaling import lora_scaling
from rl_plugin.rollout.engines.lora_merge import is_adapter, module_of

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def engine_kwargs(rank: int) -> dict:
    """``LLM(...)`` arguments that enable LoRA adapters of rank ``rank``."""
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(f"--lora-rank {rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_loras=1, max_lora_rank=max_rank)


class VLLMAdapters:
    def __init__(self, rank: int, alpha: float):
        self.rank, self.alpha = int(rank), float(alpha)
        self.adapters: Dict[str, torch.Tensor] = {}
        self.dirty = False
        self.lora_id = 0
        self.request = None  # the LoRARequest every generate passes (None before the first sync)
        self.root = Path(tempfile.mkdtemp(prefix="rl_plugin_vllm_lora_"))

    def receive(self, bucket: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Keep the bucket's adapter tensors; returns the rest (non-adapter tensors)."""
        rest = {}
        for name, value in bucket.items():
            if is_adapter(name):
                self.adapters[name] = value.detach().to("cpu", torch.float32, copy=True)
                self.dirty = True
            else:
                rest[name] = value
        return rest

    def current(self, llm):
        """The LoRARequest of the newest adapters, registered with vLLM (replacing the last)."""
        if not self.dirty:
            return self.request
        from vllm.lora.request import LoRARequest

        self.lora_id += 1
        path = self.root / f"sync_{self.lora_id}"
        targets = sorted({module_of(n).rsplit(".", 1)[-1] for n in self.adapters})
        write_peft_dir(str(path), self.adapters, rank=self.rank, alpha=self.alpha, dropout=0.0, targets=targets)
        request = LoRARequest(f"rl_plugin_sync_{self.lora_id}", self.lora_id, str(path))
        if self.request is not None:
            llm.llm_engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
        llm.llm_engine.add_lora(request)
        self.request, self.dirty = request, False
        return request

    def read_back(self, llm) -> Dict[str, torch.Tensor]:
        """The adapters the LoRA layers hold (module docstring), under canonical names."""
        if self.request is None:
            return {}
        from vllm import SamplingParams

        # vLLM copies a registered adapter into its layers' slots when a request uses it: one token
        llm.generate(
            [{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), lora_request=self.request, use_tqdm=False
        )
        modules = sorted({module_of(n) for n in self.adapters})
        shards = llm.collective_rpc(_read_lora_slots, args=(lora_scaling(self.alpha, self.rank), self.rank, modules))
        if len(shards) != 1:
            raise NotImplementedError("LoRA read-back from a tensor-parallel vLLM engine: check with TP 1")
        return shards[0]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _read_lora_slots(worker, scaling: float, rank: int, modules) -> Dict[str, torch.Tensor]:
    """Runs inside a vLLM worker: slot 0 of the LoRA layers of ``modules`` (HF module paths; a
    packed layer holds several), as canonical adapter names. Other LoRA-capable layers vLLM
    wrapped (embeddings, the head) carry no adapter of ours and are skipped."""
    wanted = set(modules)
    model = worker.model_runner.model
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: Dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        a_stacked: Optional[tuple] = getattr(module, "lora_a_stacked", None)
        if not isinstance(a_stacked, (tuple, list)) or not hasattr(module, "lora_b_stacked"):
            continue
        parent, _, leaf = name.rpartition(".")
        subs = packed.get(leaf, [leaf])
        if len(subs) != len(a_stacked):
            subs = [leaf]
        for sub, a, b in zip(subs, a_stacked, module.lora_b_stacked):
            path = f"{parent}.{sub}"
            if path not in wanted:
                continue
            out[f"{path}.lora_A.weight"] = a[0, 0, :rank].detach().to("cpu", torch.float32).clone()
            out[f"{path}.lora_B.weight"] = (b[0, 0, :, :rank].detach().to("cpu", torch.float32) / scaling).clone()
    return out
