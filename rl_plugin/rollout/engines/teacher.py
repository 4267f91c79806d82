"""An engine-served OPD teacher (``--use-opd --opd-type hf|vllm``): the teacher's log-prob of each
token the student sampled, as prompt log-probs of the whole sample (the teacher never generates).

    teacher_log_probs[t] = log softmax(logits_teacher(tokens[:t]) / T)[tokens[t]]

for every response token t of every sample, ``[sum R_i]`` fp32 in the rollout's order; T the
rollout temperature (the trainer's log-probs use the same, so student and teacher compare at it).
``hf``: one padded forward of a transformers model in the rollout manager's process. ``vllm``: a
vLLM ``LLM`` with ``prompt_logprobs=0`` and one generated token per sample (its prompt log-probs
are the actual tokens' log-probs). Rollout manager only (``rollout.manager``).
"""

from __future__ import annotations

from typing import List

import torch

from rl_plugin.cp import exclusive_cumsum


class HFTeacher:
    def __init__(self, path: str, *, temperature: float = 1.0, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
        self.temperature, self.device = float(temperature), device

    @torch.no_grad()
    def log_probs(
        self, tokens: torch.Tensor, total_lengths: torch.Tensor, response_lengths: torch.Tensor
    ) -> torch.Tensor:
        """``[sum R_i]`` teacher log-probs of the samples' response tokens (module docstring)."""
        tl, rl = total_lengths.long(), response_lengths.long()
        n, width = tl.numel(), int(tl.max()) if tl.numel() else 0
        if n == 0:
            return torch.zeros(0)
        starts = exclusive_cumsum(tl)
        col = torch.arange(width)
        valid = col[None, :] < tl[:, None]  # [n, width]
        flat = (starts[:, None] + col[None, :]).clamp(max=max(tokens.numel() - 1, 0))
        ids = torch.where(valid, tokens[flat], torch.zeros((), dtype=tokens.dtype)).to(self.device)
        logits = self.model(input_ids=ids, attention_mask=valid.long().to(self.device)).logits.float()
        logp = torch.log_softmax(logits / self.temperature, dim=-1)
        # response token t of sample i sits at position tl_i - rl_i + j and is predicted at one less
        pos_in = (tl - rl).repeat_interleave(rl) + _ranks(rl)
        row = torch.arange(n).repeat_interleave(rl)
        target = ids[row, pos_in]
        return logp[row, pos_in - 1, target].float().cpu()


class VLLMTeacher:
    def __init__(self, path: str, *, temperature: float = 1.0, seed: int = 0, device: str = "cpu"):
        from rl_plugin.rollout.engines.vllm_engine import BLOCK_SIZE, _engine_environment

        _engine_environment()  # before ``import vllm``: in-process core, a small CPU KV cache
        from transformers import AutoConfig
        from vllm import LLM

        max_len = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        self.llm = LLM(
            model=str(path),
            skip_tokenizer_init=True,  # ids in, log-probs out
            dtype="float32" if device == "cpu" else "auto",
            seed=int(seed),
            max_model_len=None if max_len is None else int(max_len),
            block_size=BLOCK_SIZE,
            enforce_eager=True,
        )
        self.temperature = float(temperature)

    def log_probs(
        self, tokens: torch.Tensor, total_lengths: torch.Tensor, response_lengths: torch.Tensor
    ) -> torch.Tensor:
        from vllm import SamplingParams, TokensPrompt

        if self.temperature != 1.0:
            raise ValueError(
                "--opd-type vllm scores at temperature 1 (vLLM's prompt log-probs are of the raw logits); "
                "use --opd-type megatron or hf with --rollout-temperature"
            )
        seqs: List[List[int]] = [t.tolist() for t in tokens.split(total_lengths.long().tolist())]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        vals: List[float] = []
        for seq, r, out in zip(seqs, response_lengths.long().tolist(), outs):
            plp = out.prompt_logprobs  # [None, {id: Logprob}, ...] per prompt position
            vals.extend(plp[p][seq[p]].logprob for p in range(len(seq) - r, len(seq)))
        return torch.tensor(vals, dtype=torch.float32)


def _ranks(lengths: torch.Tensor) -> torch.Tensor:
    """``[sum L]``: 0..L_i-1 for each run i."""
    starts = exclusive_cumsum(lengths)
    return torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)


def make_teacher(kind: str, path: str, *, temperature: float, seed: int = 0, device: str = "cpu"):
    """The engine-served teacher of ``--opd-type kind`` (``hf`` or ``vllm``) on ``device``."""
    if kind == "hf":
        return HFTeacher(path, temperature=temperature, device=device)
    if kind == "vllm":
        return VLLMTeacher(path, temperature=temperature, seed=seed, device=device)
    raise ValueError(f"--opd-type {kind}: no engine-served teacher of that kind (hf, vllm)")
