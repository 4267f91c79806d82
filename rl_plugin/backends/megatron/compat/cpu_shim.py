"""Patches that let megatron-core 0.16.1 train on a CPU under gloo, or on a GPU without
transformer-engine.

Each patch and override names when it is needed (``WHEN``, decided by ``needed(when, cuda=, te=)``):

- ``WITHOUT_CUDA``: a CPU-only torch build or a machine without a GPU. There a "cuda" device would
  crash anyway, so each patch turns a crash into the CPU equivalent and changes no number; on a
  machine with CUDA these touch nothing (patches 1-7, the CPU tuning below).
- ``WITHOUT_TE``: wherever transformer-engine is absent (or cannot run: no CUDA), GPUs included
  (issue 37 item 7): the local layer spec then runs megatron-core's own modules, whose gaps do
  not depend on the device (patch 8; ``masked_softmax_fusion`` off, see ``CONFIG_OVERRIDES``).

``apply_cpu_shim()`` applies the patches this process needs, once each (idempotent), and returns
their names (empty on a GPU machine with transformer-engine).

The patches and the megatron-core 0.16.1 lines they cover:

1. ``rng_tracker``: ``tensor_parallel/random.py`` ``CudaRNGStatesTracker.add`` (l. 216-240:
   ``torch.cuda.get_rng_state`` / ``_set_cuda_rng_state``) and ``.fork`` (l. 242-280:
   ``_get_cuda_rng_state``/``_set_cuda_rng_state``), called by ``model_parallel_cuda_manual_seed``
   and by every weight init / dropout under ``get_cuda_rng_tracker().fork()``. Replaced by the same
   bookkeeping over CPU generator states (``torch.get_rng_state`` / ``set_rng_state``).
2. ``current_device``: ``torch.cuda.current_device()`` used as a device argument
   (``distributed/param_and_grad_buffer.py`` grad/param buffers, ``distributed/distributed_data_parallel.py``,
   ``optimizer/distrib_optimizer.py`` shard buffers, ``tensor_parallel/layers.py`` weight
   allocation, ``utils.py`` ``get_model_config``/global memory buffer). Returns ``"cpu"``.
3. ``cuda_device_literals``: hard-coded ``device='cuda'`` / ``device="cuda"`` in factory calls
   (``optimizer/optimizer.py`` l. 473-485 ``found_inf``/``_dummy_overflow_buf``/``_scale_one``,
   l. 907 ``_scale``; ``optimizer/clip_grads.py`` l. 90, 103, 115, 174, 207;
   ``pipeline_parallel/schedules.py`` l. 596, 983, 2138 ``total_num_tokens``;
   ``optimizer/grad_scaler.py`` l. 15, 88-94; ``distributed/param_and_grad_buffer.py`` l. 768;
   ``transformer/utils.py`` l. 35 ``get_default_causal_mask``; ``utils.py``,
   ``pipeline_parallel/utils.py``, ``rerun_state_machine.py``, ``dist_checkpointing`` exchange/saver).
   In those modules only, ``torch.tensor/zeros/ones/empty/full`` map a ``"cuda"`` device to
   ``"cpu"`` (the module's ``torch`` global is a forwarding proxy).
4. ``tensor_type_names``: ``Tensor.type()`` string checks against ``'torch.cuda.FloatTensor'`` /
   ``'torch.cuda.BFloat16Tensor'`` (``optimizer/optimizer.py`` l. 680-700 in
   ``Float16OptimizerWithFloat16Params``, ``optimizer/distrib_optimizer.py`` l. 410-435,
   ``optimizer/clip_grads.py`` l. 167). ``Tensor.type()`` with no argument reports a CPU
   tensor under its CUDA type name; ``Tensor.type(dtype)`` (a conversion) is unchanged.

5. ``cuda_synchronize``: ``torch.cuda.synchronize()`` after the pipeline's P2P ops
   (``pipeline_parallel/p2p_communication.py`` l. 242 ``_communicate_shapes``, l. 398
   ``_communicate`` with ``batch_p2p_sync``). Without CUDA there is nothing to synchronise: a
   no-op (gloo's ``isend`` / ``irecv`` are complete once ``wait()`` returns, which megatron calls).
6. ``embedding_group_copy``: ``LanguageModule.setup_embeddings_and_output_layer``
   (``models/common/language_module/language_module.py`` l. 244: ``weight.data =
   weight.data.cuda()`` before the all-reduce that copies the tied embedding from the first
   pipeline stage to the last). During that call only, ``Tensor.cuda()`` returns the tensor
   itself (it is on the CPU already; the gloo all-reduce that follows is megatron's own).
7. ``moe_dispatcher_stream``: ``MoEAlltoAllTokenDispatcher.__init__``
   (``transformer/moe/token_dispatcher.py`` l. 444-445) creates a class-level
   ``torch.cuda.Stream()`` for its device-to-host copies of the split sizes, and
   ``_maybe_dtoh_and_synchronize`` (l. 862-900) copies on it and waits on its event. On CPU every
   tensor is on the host already, so the stream is a placeholder and the method only does what its
   copies do besides moving: the split sizes (``input_splits``, ``output_splits``,
   ``output_splits_tp``) become numpy arrays (``maybe_move_tensor_to_cpu(as_numpy=True)`` does
   that only for CUDA tensors; gloo's ``all_to_all_single`` refuses tensor split sizes).

8. ``router_gemm_name``: ``transformer/moe/moe_utils.py`` binds ``te_general_gemm`` only when
   transformer-engine imports (l. 22-39), but ``RouterGatingLinearFunction`` (l. 1192, 1225)
   reads it unconditionally: without transformer-engine every router forward raises NameError.
   The name is bound to None, which selects the function's own ``torch.mm`` branch. Needed
   WITHOUT_TE: a GPU machine without transformer-engine raises the same NameError.
   megatron-core 0.19 binds it to None itself: delete this patch with the move to 0.19.

Config overrides (``cpu_config_overrides(cuda, te)``, each with its ``WHEN``; megatron-core's and
mbridge's settings stand wherever an override is not needed):

- ``masked_softmax_fusion`` off WITHOUT_TE: mbridge turns it on, and megatron-core's
  ``FusedScaleMaskSoftmax`` with a causal layer (``attn_mask_type=causal``) runs
  ``ScaledUpperTriangMaskedSoftmax``, which applies the upper-triangular mask and IGNORES the mask
  it is given (``fusions/fused_softmax.py`` ``forward_fused_softmax``) whenever its shape rules
  hold (bf16, 16 < sk <= 4096, multiples of 4). ``local_attention`` attends packed samples under a
  block-diagonal causal mask: with the fusion, samples would attend to each other. (Its kernel is
  Megatron's / apex's compiled extension besides, absent on a CPU.) With transformer-engine the
  TE spec attends thd natively and the fusion is TE's business.
- WITHOUT_CUDA: bias + activation, bias + dropout, RoPE, gradient-accumulation fusion (CUDA
  kernels or apex extensions) and the shared-expert overlap (a ``torch.cuda.Stream``).
- ``install_cpu_rope()``: ``rope_thd`` (megatron-core's unfused packed RoPE without its
  per-sample loop, bitwise equal; it keys a cache on ``cu_seqlens`` values, a host sync per call
  on a GPU): WITHOUT_CUDA only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import types
from typing import Dict, List

import torch

APPLIED: List[str] = []  # names of the patches applied in this process, in order
_ORIGINALS: Dict[str, object] = {}

WITHOUT_CUDA, WITHOUT_TE = "without CUDA", "without transformer-engine"


def cuda_present() -> bool:
    return bool(torch.cuda.is_available())


def te_present() -> bool:
    """Whether transformer-engine is installed (``bridge.transformer_engine_available``'s test)."""
    return importlib.util.find_spec("transformer_engine") is not None


def needed(when: str, *, cuda: bool, te: bool) -> bool:
    """Whether a patch or override marked ``when`` applies on a machine with (``cuda``, ``te``)."""
    if when == WITHOUT_CUDA:
        return not cuda
    if when == WITHOUT_TE:  # transformer-engine runs on CUDA only: a CPU has none to use
        return not (te and cuda)
    raise ValueError(f"unknown condition {when!r}")


# -- 1. RNG tracker on CPU generator states -------------------------------------------------
def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CudaRNGStatesTracker
    _ORIGINALS["rng_add"], _ORIGINALS["rng_fork"] = cls.add, cls.fork

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    cls.add, cls.fork = add, fork


# -- 2. torch.cuda.current_device -----------------------------------------------------------
def _patch_current_device() -> None:
    _ORIGINALS["current_device"] = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"


# -- 3. device="cuda" in factory functions --------------------------------------------------
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")
# The megatron-core modules with hard-coded "cuda" factory calls. Only THEIR ``torch`` global is
# replaced (by a proxy), never the global ``torch``: patching ``torch.zeros`` process-wide breaks
# other libraries (transformers 5 then leaves RoPE ``inv_freq`` buffers uninitialised).
CUDA_LITERAL_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _CpuTorch(types.ModuleType):
    """``torch`` as one module sees it: factories map a "cuda" device to "cpu"; all else forwards."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value

        def factory(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return factory


def _patch_cuda_device_literals() -> None:
    proxy = _CpuTorch()
    for mod_name in CUDA_LITERAL_MODULES:
        mod = importlib.import_module(mod_name)
        _ORIGINALS[f"torch@{mod_name}"] = mod.torch
        mod.torch = proxy


# -- 4. Tensor.type() names -----------------------------------------------------------------
def _patch_tensor_type_names() -> None:
    orig = torch.Tensor.type
    _ORIGINALS["tensor_type"] = orig

    @functools.wraps(orig)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


# -- 5. torch.cuda.synchronize ----------------------------------------------------------------
def _patch_cuda_synchronize() -> None:
    _ORIGINALS["cuda_synchronize"] = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None


# -- 6. Tensor.cuda() inside the tied embedding's first-to-last-stage copy ---------------------
def _patch_embedding_group_copy() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    orig = LanguageModule.setup_embeddings_and_output_layer
    _ORIGINALS["setup_embeddings_and_output_layer"] = orig

    @functools.wraps(orig)
    def setup(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup


# -- 7. the MoE all-to-all dispatcher's device-to-host stream --------------------------------
class _NoStream:
    """Stands in for ``torch.cuda.Stream`` as the dispatcher's class-level D2H stream (never used)."""


def _patch_moe_dispatcher_stream() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as cls

    _ORIGINALS["moe_dtoh_stream"] = cls.cuda_dtoh_stream
    _ORIGINALS["moe_dtoh_and_synchronize"] = cls._maybe_dtoh_and_synchronize
    cls.cuda_dtoh_stream = _NoStream()

    def dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # every tensor is on the host already: no copy, no wait; the split sizes become numpy
        # arrays at the same point as on a GPU (the all-to-all takes a sequence of ints)
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = dtoh_and_synchronize


# -- 8. the router's gating GEMM without transformer-engine ----------------------------------
def _patch_router_gemm_name() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # only bound when transformer-engine imports
        moe_utils.te_general_gemm = None


PATCHES = (  # (name, patch, when)
    ("rng_tracker", _patch_rng_tracker, WITHOUT_CUDA),
    ("current_device", _patch_current_device, WITHOUT_CUDA),
    ("cuda_device_literals", _patch_cuda_device_literals, WITHOUT_CUDA),
    ("tensor_type_names", _patch_tensor_type_names, WITHOUT_CUDA),
    ("cuda_synchronize", _patch_cuda_synchronize, WITHOUT_CUDA),
    ("embedding_group_copy", _patch_embedding_group_copy, WITHOUT_CUDA),
    ("moe_dispatcher_stream", _patch_moe_dispatcher_stream, WITHOUT_CUDA),
    ("router_gemm_name", _patch_router_gemm_name, WITHOUT_TE),
)


def patches_needed(*, cuda: bool, te: bool) -> List[str]:
    """The names of the patches a machine with (``cuda``, ``te``) needs, in order."""
    return [name for name, _, when in PATCHES if needed(when, cuda=cuda, te=te)]


def apply_cpu_shim(cuda: bool | None = None, te: bool | None = None) -> List[str]:
    """Apply the patches this machine needs (``patches_needed``), each once; returns their names
    (``cuda`` / ``te``: default what this process has)."""
    cuda = cuda_present() if cuda is None else cuda
    te = te_present() if te is None else te
    names = patches_needed(cuda=cuda, te=te)
    for name, patch, _ in PATCHES:
        if name in names and name not in APPLIED:
            patch()
            APPLIED.append(name)
    return names


# The TransformerConfig settings overridden, each with when (module docstring). mbridge turns
# masked_softmax_fusion on; the others are megatron-core's defaults (off) unless a bridge sets them.
CONFIG_OVERRIDES = (  # (setting, value, when)
    ("masked_softmax_fusion", False, WITHOUT_TE),  # the causal fused kernel ignores the packed samples' mask
    ("bias_activation_fusion", False, WITHOUT_CUDA),
    ("bias_dropout_fusion", False, WITHOUT_CUDA),
    ("apply_rope_fusion", False, WITHOUT_CUDA),
    ("gradient_accumulation_fusion", False, WITHOUT_CUDA),
    ("moe_shared_expert_overlap", False, WITHOUT_CUDA),  # a CUDA side stream (SharedExpertMLP)
)
CPU_CONFIG_OVERRIDES = {k: v for k, v, _ in CONFIG_OVERRIDES}  # what a CPU run (no CUDA, no TE) sets


def cpu_config_overrides(cuda: bool | None = None, te: bool | None = None) -> dict:
    """The ``CONFIG_OVERRIDES`` a machine with (``cuda``, ``te``) needs (default: this process's):
    all of them on a CPU, ``masked_softmax_fusion`` alone on a GPU without transformer-engine,
    ``{}`` on a GPU with it."""
    cuda = cuda_present() if cuda is None else cuda
    te = te_present() if te is None else te
    return {k: v for k, v, when in CONFIG_OVERRIDES if needed(when, cuda=cuda, te=te)}


def install_cpu_rope(cuda: bool | None = None) -> bool:
    """Install ``rope_thd`` without CUDA (returns True); with CUDA touch nothing (False)."""
    cuda = cuda_present() if cuda is None else cuda
    if cuda:
        return False
    from rl_plugin.backends.megatron.compat import rope_thd

    rope_thd.install()
    return True


def shim_active() -> bool:
    """Whether every patch a CPU machine needs is applied in this process."""
    return set(patches_needed(cuda=False, te=False)) <= set(APPLIED)
