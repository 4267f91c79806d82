"""Tolerances for the suite's floating-point comparisons, derived from the computation.

Two results of the same math computed in another order (another DP x CP x TP x micro-batch
layout, the other backend, another CPU's SIMD kernels) differ by rounding alone. Rounding error
scales with the magnitude of the TERMS that are combined, not with the result: a KL of 0.007 is a
mean of differences of log-probs of magnitude ~2, so its error is ~u * 2 whatever its value. So
every comparison here is

    |got - want| <= K * u * (|want| + S)

with u the unit roundoff of the precision, S the magnitude of the terms that cancel (stated at the
call site: log-probs, advantages, logits), and K a safety factor for the depth of the computation:

- ``FP32_MODEL`` (K = 256, ~1.5e-5): fp32 model forward/backward and loss, compared across
  layouts, backends or CPUs. A reordered length-n fp32 dot product differs by ~sqrt(n) * u relative
  to the sum of its |terms| (<= 16 u for the tiny models' contractions, n <= 256: hidden 32-64,
  FFN 64-256, vocab 128), and a step chains a few such contractions (forward, log-softmax,
  backward): 16 u per contraction x up to 16 chained = 256 u. Worst-case (n * u) bounds would be
  useless and are never approached by rounding that is not systematic.
- ``FP32_LOSS_CORE`` (K = 32, ~1.9e-6): the loss core alone on fp32 inputs (no model): fp32
  rounding of the inputs (1 u each), the elementwise policy terms (exp: <= 2 ulp, products) and one
  reordered reduction over a step's <= ~100 tokens (sqrt(100) = 10 u): < 16 u, twice that.
- ``FP64`` (K = 256, ~2.8e-14): fp64 paths (the loss core on fp64 inputs, fp64 references).
  Same reasoning; fp64 results match to ~1e-15 relative on every x86-64 CPU.
- ``FP64_ELEMENTWISE`` (K = 16, ~1.8e-15): fp64 elementwise formulas with no reduction (one
  exp/log may differ by an ulp between SLEEF's AVX2 and AVX-512 paths and libm).

- ``BF16_ROUND`` (4 u_bf16 = 2^-7): a result rounded once to bf16 after fp32 accumulation.
- ``BF16_MODEL`` (16 u_bf16 ~ 3.1e-2): a bf16 model step against its fp32 twin (weights,
  activations and the chained contractions each round to bf16).

Checked against other CPUs' kernels on one machine: torch's ``ATEN_CPU_CAPABILITY`` env var forces
its AVX2 or scalar (``default``) kernels instead of AVX-512, e.g.
``ATEN_CPU_CAPABILITY=default .venv/bin/python -m pytest tests/fast/backends/fsdp/test_backend.py``. The
parity, snapshot and log-prob tests pass under all three; the fixed-tolerance suite before this
module failed under ``default`` with the same ``ppo_kl`` error another machine's CPU produced.

None of these is near what a real bug produces: a wrong denominator (counts not all-reduced, a
CP chunk counted twice, a padding token in a sum) changes J or a gradient by >= 1e-3 relative, and
the parity tests' mutation checks fail by >= 1e-2.
"""

from __future__ import annotations

import torch

U32 = 2.0**-24  # fp32 unit roundoff (half an ulp of 1.0)
U64 = 2.0**-53  # fp64 unit roundoff
U_BF16 = 2.0**-9  # bf16 unit roundoff (8 bits of mantissa)

FP32_MODEL = 256 * U32
FP32_LOSS_CORE = 32 * U32
FP64 = 256 * U64
FP64_ELEMENTWISE = 16 * U64
BF16_ROUND = 4 * U_BF16
BF16_MODEL = 16 * U_BF16


def within(got, want, *, rtol: float, scale: float = 0.0) -> bool:
    """``|got - want| <= rtol * (|want| + scale)``: scalars."""
    got, want = float(got), float(want)
    return abs(got - want) <= rtol * (abs(want) + float(scale))


def tensor_within(got: torch.Tensor, want: torch.Tensor, *, rtol: float, scale: float = 0.0) -> bool:
    """``max |got - want| <= rtol * (max |want| + scale)``: the error of every element against the
    largest magnitude in the tensor (elements are computed from terms of that magnitude)."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max()) <= rtol * (float(want.abs().max()) + float(scale))


def max_abs(*tensors: torch.Tensor) -> float:
    """The largest magnitude over ``tensors`` (a scale S for the bound above)."""
    return max(float(t.detach().double().abs().max()) for t in tensors if t.numel())
