"""An engine-served OPD teacher (``--use-opd --opd-type hf|vllm``): the teacher's log-prob of each
token the student sampled, as prompt log-probs of the whole sample (the teacher never generates).

    teacher_log_probs[t] = log softmax(logits_teacher(tokens[:t]) / T)[tokens[t]]

for every response token t of every sample, ``[sum R_i]`` fp32 in the rollout's order; T the
rollout temperature (the trainer's log-probs use the same, so student and teacher compare at it).
Rollout manager only (``rollout.manager``).

``hf``: a transformers model in the rollout manager's process, scored in micro-batches of at most
``--opd-teacher-max-tokens`` padded tokens (samples sorted by length, so a micro-batch pads little;
a sample longer than the budget goes alone). Each micro-batch runs the model's decoder once
(``[m, width, H]`` hidden states) and the response rows' log-probs go through the fused LM head
(``rl_plugin.loss.fused_log_probs_and_entropy``: ``z = h W^T / T`` a few rows at a time, only the
per-token log-sum-exp kept), so neither the rollout's nor a micro-batch's ``[tokens, V]`` logits
exist. A model whose logits are more than ``h W^T`` (a biased head, soft-capping: ``models.hf_head``)
is refused at load.

``vllm``: a vLLM ``LLM`` with ``prompt_logprobs=0`` and one generated token per sample (its prompt
log-probs are the actual tokens' log-probs); on a GPU it takes ``--opd-teacher-gpu-memory-utilization``
of the device (vLLM's default 0.9 would leave nothing to the engine beside it).
"""

from __future__ import annotations

from typing import Iterator, List

import torch

from rl_plugin.cp import exclusive_cumsum
from rl_plugin.loss import fused_log_probs_and_entropy
from rl_plugin.loss_config.opd import TEACHER_MAX_TOKENS, TEACHER_MEMORY_SHARE
from rl_plugin.models.hf_head import fused_head_unsupported


class HFTeacher:
    def __init__(
        self, path: str, *, temperature: float = 1.0, device: str = "cpu", max_tokens: int = TEACHER_MAX_TOKENS
    ):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
        reason = fused_head_unsupported(self.model)
        if reason is not None:
            raise ValueError(
                f"--opd-teacher-load {path} with --opd-type hf: {reason}, and the hf teacher scores through the fused "
                "LM head. Fix: use --opd-type megatron (the trainer's teacher) or vllm"
            )
        self.decoder = self.model.get_decoder()  # the hidden states the head reads (final norm included)
        self.head = self.model.get_output_embeddings().weight  # [V, H]
        self.temperature, self.device, self.max_tokens = float(temperature), device, int(max_tokens)

    @torch.no_grad()
    def log_probs(
        self, tokens: torch.Tensor, total_lengths: torch.Tensor, response_lengths: torch.Tensor
    ) -> torch.Tensor:
        """``[sum R_i]`` teacher log-probs of the samples' response tokens (module docstring)."""
        tl, rl = total_lengths.long(), response_lengths.long()
        out = torch.empty(int(rl.sum()), dtype=torch.float32)
        if tl.numel() == 0:
            return out
        if bool((rl >= tl).any()):
            raise ValueError("a teacher-scored sample needs a prompt token before its response")
        starts, out_starts = exclusive_cumsum(tl), exclusive_cumsum(rl)
        for samples in micro_batches(tl, self.max_tokens):
            lp = self._score(tokens, starts[samples], tl[samples], rl[samples])
            out[out_starts[samples].repeat_interleave(rl[samples]) + _ranks(rl[samples])] = lp
        return out

    def _score(self, tokens, starts, tl, rl) -> torch.Tensor:
        """``[sum rl]`` log-probs of one micro-batch: one padded decoder forward, the fused head."""
        m, width = tl.numel(), int(tl.max())
        col = torch.arange(width)
        valid = col[None, :] < tl[:, None]  # [m, width]
        flat = (starts[:, None] + col[None, :]).clamp(max=max(tokens.numel() - 1, 0))
        ids = torch.where(valid, tokens[flat], torch.zeros((), dtype=tokens.dtype)).to(self.device)
        hidden = self.decoder(input_ids=ids, attention_mask=valid.long().to(self.device)).last_hidden_state
        # response token j of sample i sits at position tl_i - rl_i + j and is predicted one before
        pos_in = ((tl - rl).repeat_interleave(rl) + _ranks(rl)).to(self.device)
        row = torch.arange(m, device=self.device).repeat_interleave(rl.to(self.device))
        logp, _ = fused_log_probs_and_entropy(
            hidden[row, pos_in - 1].float(),
            self.head,
            ids[row, pos_in],
            temperature=self.temperature,
            with_entropy=False,
        )
        return logp.float().cpu()


def micro_batches(total_lengths: torch.Tensor, max_tokens: int) -> Iterator[torch.Tensor]:
    """Sample indices per teacher forward: longest first, each batch at most ``max_tokens`` padded
    tokens (its count x its longest length; a longer sample alone). Planning only: one pass over the
    sorted lengths, no tensor work per sample."""
    order = torch.argsort(total_lengths, descending=True, stable=True)
    lengths = total_lengths[order].tolist()
    first = 0
    while first < len(lengths):
        # sorted descending: the batch's width is its first sample's length
        take = max(1, min(len(lengths) - first, max_tokens // max(1, lengths[first])))
        yield order[first : first + take]
        first += take


class VLLMTeacher:
    def __init__(
        self,
        path: str,
        *,
        temperature: float = 1.0,
        seed: int = 0,
        device: str = "cpu",
        memory_share: float = TEACHER_MEMORY_SHARE,
    ):
        from rl_plugin.rollout.engines.vllm_engine import BLOCK_SIZE, engine_environment

        engine_environment()  # before ``import vllm``: in-process core, a small CPU KV cache
        from transformers import AutoConfig
        from vllm import LLM

        max_len = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        memory = {} if device == "cpu" else {"gpu_memory_utilization": float(memory_share)}
        self.llm = LLM(
            model=str(path),
            skip_tokenizer_init=True,  # ids in, log-probs out
            dtype="float32" if device == "cpu" else "auto",
            seed=int(seed),
            max_model_len=None if max_len is None else int(max_len),
            block_size=BLOCK_SIZE,
            enforce_eager=True,
            **memory,
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


def make_teacher(
    kind: str,
    path: str,
    *,
    temperature: float,
    seed: int = 0,
    device: str = "cpu",
    max_tokens: int = TEACHER_MAX_TOKENS,
    memory_share: float = TEACHER_MEMORY_SHARE,
):
    """The engine-served teacher of ``--opd-type kind`` (``hf`` or ``vllm``) on ``device``;
    ``max_tokens``: ``--opd-teacher-max-tokens`` (hf), ``memory_share``:
    ``--opd-teacher-gpu-memory-utilization`` (vllm on a GPU)."""
    if kind == "hf":
        return HFTeacher(path, temperature=temperature, device=device, max_tokens=max_tokens)
    if kind == "vllm":
        return VLLMTeacher(path, temperature=temperature, seed=seed, device=device, memory_share=memory_share)
    raise ValueError(f"--opd-type {kind}: no engine-served teacher of that kind (hf, vllm)")
