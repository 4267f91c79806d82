"""FSDP2 backend: PyTorch ``fully_shard`` on a Hugging Face causal LM, trained on the shared loss core.

Data parallelism only (cp = tp = 1); ``--context-parallel-size`` / ``--tensor-model-parallel-size``
> 1 are rejected at start-up (``TrainConfig.check``). Files:

- ``model.py``      load the HF model, ``--fp32-lm-head``, shard it (per decoder layer, then root)
- ``packing.py``    model inputs of a packed (thd) or padded (bshd) micro-batch; logits -> rows
- ``optim.py``      AdamW with Megatron's flag defaults, Megatron's LR schedule, clipping on DTensors
- ``lora.py``       ``--lora-rank``: PEFT's adapters before sharding, our initial A / zero B, the adapter stream
- ``checkpoint.py`` torch.distributed.checkpoint save/load (model, optimizer, RNG, step); HF export
- ``backend.py``    ``FSDPBackend``, the ``TrainBackend`` the loop drives
"""
