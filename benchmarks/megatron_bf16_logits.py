"""Peak memory of the Megatron head under ``--bf16``: response rows indexed before the fp32 upcast.

Before (issue 9): the ``Float16Module`` cast the model's output to fp32, so the unfused path held
every position's logits twice, bf16 and fp32 ``[s, V/tp]``, and the backward an fp32 gradient of
that size; the fused path held an fp32 copy of the ``[s, 1, H]`` hidden states. After: the module
is asked for its bf16 output (``fp32_output=False``), the response rows are indexed out, and only
they are upcast (``backends/megatron/forward.py``). Log-probs and gradients are bitwise the same
(``tests/fast/backends/megatron/test_fp32_head.py::test_bf16_logits_indexed_before_upcast``).

One process (gloo, 1 thread), a tiny Qwen2 with a 32k vocabulary, one micro-batch of long prompts
and short responses (RL's shape: few response rows, many positions). Each case is forward +
backward of ``sum(logp) + sum(entropy)``; its peak is the kernel's high-water mark of the resident
set over the pass (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident set
before it, best (lowest) of ``--repeat`` alternating runs. "before" is the old code path, run here
in the same process as the baseline.

    python -m benchmarks.megatron_bf16_logits [--vocab 32768] [--prompt 1024] [--samples 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time

from tests.support.harness import run_world


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+) kB", f.read()).group(1)) / 1024


def _reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _worker(rank, world, hf_dir, vocab, prompt, samples, repeat):
    import torch

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.forward import hidden_states_only, model_inputs, response_log_probs, unwrap
    from rl_plugin.loss import ForwardOptions, log_probs_and_entropy, prepare_step
    from rl_plugin.loss.fused_head import default_chunk_rows, fused_log_probs_and_entropy
    from tests.support.megatron_common import make_args, synthetic_batch

    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, "--bf16"))
    model, gpt, ps = backend.model, unwrap(backend.model), backend.parallel_state
    batch, groups = synthetic_batch(
        seed=0, num_prompts=samples, n_per_prompt=1, vocab=vocab, max_prompt=prompt, max_response=16
    )
    mb = prepare_step(batch, backend.loss_config, ps, num_groups=groups).micro_batch(torch.arange(batch.num_samples))
    ids, pos, psp = model_inputs(mb, "thd")
    idx, hid = mb.layout.logit_index, gpt.config.hidden_size

    def before(fused):  # the old code: the Float16Module's fp32 output, then the rows
        if fused:
            with hidden_states_only(gpt):
                hidden = model(ids, pos, None, packed_seq_params=psp)
            rows = hidden.transpose(0, 1).reshape(-1, hid)[idx]
            return fused_log_probs_and_entropy(
                rows,
                gpt.output_layer.weight,
                mb.targets,
                chunk_size=min(1024, default_chunk_rows(gpt.output_layer.weight.shape[0])),
            )
        logits = model(ids, pos, None, packed_seq_params=psp)
        return log_probs_and_entropy(logits.reshape(-1, logits.shape[-1])[idx], mb.targets, chunk_size=1024)

    def after(fused):
        return response_log_probs(
            model,
            mb,
            ForwardOptions(temperature=1.0, chunk_size=1024, with_entropy=True),
            ps,
            qkv_format="thd",
            fp32_lm_head=False,
            fused=fused,
        )

    def run(fn, fused):
        model.zero_grad_buffer()
        rss = _reset_peak()
        t0 = time.perf_counter()
        logp, ent = fn(fused)
        (logp.sum() + ent.sum()).backward()
        dt = time.perf_counter() - t0
        return _status("VmHWM") - rss, dt

    for fused in (False, True):  # warm-up (allocator, lazy init)
        run(before, fused)
        run(after, fused)
    rows = []
    for fused in (False, True):
        best = {"before": (float("inf"), float("inf")), "after": (float("inf"), float("inf"))}
        for _ in range(repeat):
            for name, fn in (("before", before), ("after", after)):
                mem, dt = run(fn, fused)
                best[name] = (min(best[name][0], mem), min(best[name][1], dt))
        rows.append(("fused head" if fused else "unfused (logits)", best))
    return {"rows": rows, "positions": ids.numel(), "response_rows": int(idx.numel()), "vocab": vocab, "hidden": hid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompt", type=int, default=1024, help="max prompt tokens per sample")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    hf_dir = str(
        make_tiny_hf_checkpoint(
            os.path.join(tempfile.gettempdir(), f"rl_plugin_bench_v{a.vocab}"),
            "qwen2",
            vocab_size=a.vocab,
            max_position_embeddings=max(512, 2 * a.prompt),
        )
    )
    out = run_world(_worker, 1, hf_dir, a.vocab, a.prompt, a.samples, a.repeat)[0]
    s, v = out["positions"], out["vocab"]
    print(
        f"Megatron --bf16 head, one micro-batch: {s} positions, {out['response_rows']} response rows, vocab {v}, "
        f"hidden {out['hidden']} (one fp32 [s, V] buffer = {s * v * 4 / 2**20:.1f} MiB)"
    )
    print(
        f"{'path':<18} {'before MiB':>11} {'after MiB':>10} {'saved MiB':>10} {'after/before':>13} "
        f"{'before s':>9} {'after s':>8} {'time ratio':>11}"
    )
    for name, best in out["rows"]:
        (mb0, t0), (mb1, t1) = best["before"], best["after"]
        print(
            f"{name:<18} {mb0:>11.1f} {mb1:>10.1f} {mb0 - mb1:>10.1f} {mb1 / max(mb0, 1e-9):>12.2f}x "
            f"{t0:>9.3f} {t1:>8.3f} {t1 / t0:>10.2f}x"
        )


if __name__ == "__main__":
    main()
