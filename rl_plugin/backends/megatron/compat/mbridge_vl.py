"""mbridge 0.15.1's Qwen2.5-VL bridge on megatron-core 0.16.1 without transformer-engine.

``vl_bridge_class(base, model_class)`` subclasses mbridge's ``Qwen2_5VLBridge`` (``base``) so that
``bridge._model_provider`` builds ``model_class`` (mbridge's ``Qwen2_5VLModel`` or a subclass)
on megatron-core's LOCAL specs, with the checkpoint's own vision sizes; every weight still moves
through mbridge's name maps and its q/k/v and gate/up conversions (``load_weights`` /
``export_weights`` / ``save_weights``). What mbridge 0.15.1 does not do here, each fixed below:

1. Its provider imports ``TEColumnParallelLinear`` / ``TERowParallelLinear`` and
   ``get_vit_layer_with_transformer_engine_spec`` (ImportError without transformer-engine), and
   its language spec is ``get_gpt_decoder_block_spec(use_transformer_engine=True)``. Here: the
   language layers are ``get_gpt_decoder_block_spec(use_transformer_engine=False)`` with the packed
   causal kernel ``local_attention.VarlenDotProductAttention``; the vision layers the same local
   GPT layer (RMSNorm, as Qwen2.5-VL's blocks; megatron-core's ``get_vit_layer_with_local_spec``
   has LayerNorm and a CAUSAL mask) with ``AttnMaskType.no_mask`` and ``VarlenFullAttention``
   (each window / image attends within itself, both directions); the projector's linears
   ``ColumnParallelLinear`` / ``RowParallelLinear``.
2. ``get_vision_model_config`` hard-codes the 7B vision tower (32 blocks of 1280, 16 heads, a
   112-pixel window, full attention at 7/15/23/31, an FFN of 3420/3456): here every size is read
   from ``hf_config.vision_config`` (depth, hidden, heads, intermediate, window, full-attention
   blocks, patch / merge sizes, its activation), the norms' epsilon 1e-6 as HF's.
3. transformers 5 keeps the text sizes in ``hf_config.text_config`` and M-RoPE's sections and
   ``rope_theta`` in ``rope_parameters``: ``_build_config`` reads them there, and the sizes
   mbridge's q/k/v conversion reads on the top-level config (``num_key_value_heads``,
   ``num_attention_heads``, ``hidden_size``, ``head_dim``) are copied there (``TEXT_SIZES``).
4. The local spec's separate norms (``input_layernorm``, ``pre_mlp_layernorm``) are not in
   mbridge's VL name maps (it maps TE's fused ``layer_norm_weight``); they are added, for the
   language layers and the vision blocks (mbridge's ``_weight_name_mapping_other`` also reads the
   layer number at the wrong index for ``language_model.decoder.layers.N``).
5. As ``mbridge_fixes.tied_embeddings_bridge_class``: mbridge writes a tied output layer into the
   CLASS's ``_DIRECT_MAPPING``; each bridge keeps its own copy.

6. mbridge's ``Qwen2_5VLSelfAttention.forward`` (absolute M-RoPE frequencies per token) lacks
   the ``rotary_pos_cos_sin`` keyword megatron-core 0.16.1's ``TransformerLayer`` passes
   (TypeError): ``VLSelfAttention`` takes it (always None here: no fused RoPE cache) and drops it;
   the model's ``__init__`` installs it on both specs in place of mbridge's class (a scoped
   patch of the name it reads, ``_vl_attention``).

7. mbridge's ``_get_mcore_config_by_name`` returns the language config for every weight, so under
   TP > 1 the merger's ``vision_model.projection.encoder.linear_fc1`` (not gated) is split as a
   gated gate/up pair (wrong shards): the merger's names get the projection config.
8. mbridge exports transformers 4's names (``model.layers.*``, ``visual.*``); transformers 5's
   Qwen2.5-VL model (the hf engine's, FSDP's export, the weight sync's target) names them
   ``model.language_model.*`` and ``model.visual.*`` (its loader converts the old names, so a
   checkpoint in either form loads): ``_weight_to_hf_format`` gives the new names
   (``transformers5_name``); loading still reads the checkpoint's old names.

The probe test ``tests/fast/backends/megatron/compat/test_mbridge_vl.py`` fails when mbridge's own
provider starts building without transformer-engine (then 1 can go).
"""

from __future__ import annotations

import contextlib
from copy import deepcopy
from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rl_plugin.backends.attention_mask import block_mask


class VarlenFullAttention(DotProductAttention):
    """The local core attention for the vision tower: a packed (``thd``) stream ``[t, heads, dim]``
    attended as one row under the block-diagonal mask of ``cu_seqlens_q`` (token ``a`` sees ``b``
    iff both lie in the same window / image; no causality), returning ``[t, heads * dim]``."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias
            )
        cu = packed_seq_params.cu_seqlens_q.to(query.device).long()
        t = query.shape[0]
        mask = (~block_mask(cu, t)).view(1, 1, t, t)  # True = masked out (megatron's convention)
        out = super().forward(
            query.unsqueeze(1),
            key.unsqueeze(1),
            value.unsqueeze(1),
            mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
        )
        return out.reshape(t, -1)


def _vl_self_attention():
    from mbridge.models.qwen2_5_vl.attention import Qwen2_5VLSelfAttention

    class VLSelfAttention(Qwen2_5VLSelfAttention):
        """Fix 6: mbridge's attention taking megatron-core 0.16.1's ``rotary_pos_cos_sin``."""

        def forward(self, *args, rotary_pos_cos_sin=None, **kwargs):
            if rotary_pos_cos_sin is not None:
                raise NotImplementedError("mbridge's Qwen2.5-VL attention has no fused RoPE cache")
            return super().forward(*args, **kwargs)

    return VLSelfAttention


@contextlib.contextmanager
def _vl_attention():
    """Fix 6: ``Qwen2_5VLModel.__init__`` puts ``VLSelfAttention`` on its specs."""
    from mbridge.models.qwen2_5_vl import model as module

    saved = module.Qwen2_5VLSelfAttention
    module.Qwen2_5VLSelfAttention = _vl_self_attention()
    try:
        yield
    finally:
        module.Qwen2_5VLSelfAttention = saved


_ACTIVATIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}


def vision_config(language_config, vc):
    """The vision tower's ``TransformerConfig`` from the language model's and HF's ``vision_config``
    (fix 2; the other fields as mbridge's ``get_vision_model_config``)."""
    c = deepcopy(language_config)
    c.num_layers = vc.depth
    c.hidden_size = vc.hidden_size
    c.num_attention_heads = vc.num_heads
    c.num_query_groups = vc.num_heads
    c.kv_channels = vc.hidden_size // vc.num_heads
    c.ffn_hidden_size = vc.intermediate_size
    if vc.hidden_act not in _ACTIVATIONS:  # a plain function: a module here would enter the state dict
        raise ValueError(
            f"vision_config.hidden_act {vc.hidden_act!r}: the Megatron backend builds {sorted(_ACTIVATIONS)}"
        )
    c.activation_func = _ACTIVATIONS[vc.hidden_act]
    c.gated_linear_unit = True
    c.add_bias_linear = True
    c.add_qkv_bias = True
    c.layernorm_epsilon = 1e-6
    c.layernorm_zero_centered_gamma = False
    c.apply_query_key_layer_scaling = False
    c.bias_activation_fusion = False
    c.bias_dropout_fusion = False
    c.attention_softmax_in_fp32 = True
    c.hidden_dropout = c.attention_dropout = 0.0
    c.seq_length = 1
    c.tp_comm_overlap = False
    c.sequence_parallel = False
    c.context_parallel_size = 1
    c.pipeline_model_parallel_size = 1
    c.first_pipeline_num_layers = None
    c.num_layers_in_first_pipeline_stage = c.num_layers_in_last_pipeline_stage = None
    c.temporal_patch_size = vc.temporal_patch_size
    c.patch_size = vc.patch_size
    c.in_channels = vc.in_channels
    c.spatial_merge_size = vc.spatial_merge_size
    c.fullatt_block_indexes = list(vc.fullatt_block_indexes)
    c._qwen2_5_vl_window_size = vc.window_size
    return c


def projection_config(language_config, vc):
    """The merger's MLP ``[hidden * merge^2] -> [hidden * merge^2] -> [out_hidden]``, GELU, biases."""
    from mbridge.models.qwen2_5_vl.transformer_config import get_vision_projection_config

    c = get_vision_projection_config(deepcopy(language_config), vc.hidden_size, vc.spatial_merge_size)
    c.layernorm_epsilon = 1e-6
    return c


def _layer_spec(spec, core_attention, mask_type=None):
    spec = deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    if mask_type is not None:
        spec.submodules.self_attention.params = {**spec.submodules.self_attention.params, "attn_mask_type": mask_type}
    return spec


TEXT_SIZES = ("num_key_value_heads", "num_attention_heads", "hidden_size", "head_dim", "vocab_size")


def text_sizes_on_top(hf_config) -> None:
    """Fix 3: the text sizes mbridge's weight conversion reads on the top-level config."""
    text = hf_config.text_config
    for name in TEXT_SIZES:
        if getattr(hf_config, name, None) is None and getattr(text, name, None) is not None:
            setattr(hf_config, name, getattr(text, name))


def transformers5_name(name: str) -> str:
    """Fix 8: a transformers 4 Qwen2.5-VL weight name in transformers 5's form."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model.") :]
    return name


def vl_bridge_class(base, model_class):
    """``base`` (mbridge's ``Qwen2_5VLBridge``) building ``model_class`` on the local specs (module docstring)."""
    lm, vis, hf_lm = (
        "language_model.decoder.layers.{layer_number}.",
        "vision_model.decoder.layers.{layer_number}.",
        "model.layers.{layer_number}.",
    )
    norms = {
        lm + "input_layernorm.weight": [hf_lm + "input_layernorm.weight"],
        vis + "input_layernorm.weight": ["visual.blocks.{layer_number}.norm1.weight"],
    }

    class LocalSpecVLBridge(base):
        def __init__(self, hf_config, *args, **kwargs):
            text_sizes_on_top(hf_config)
            super().__init__(hf_config, *args, **kwargs)

        _MLP_MAPPING = {
            **base._MLP_MAPPING,
            lm + "pre_mlp_layernorm.weight": [hf_lm + "post_attention_layernorm.weight"],
            vis + "pre_mlp_layernorm.weight": ["visual.blocks.{layer_number}.norm2.weight"],
        }

        def _adjust_mapping_for_shared_weights(self):
            self._DIRECT_MAPPING = dict(base._DIRECT_MAPPING)
            tied = getattr(self.hf_config.text_config, "tie_word_embeddings", False) or getattr(
                self.hf_config, "tie_word_embeddings", False
            )
            self._DIRECT_MAPPING["language_model.output_layer.weight"] = (
                "model.embed_tokens.weight" if tied else "lm_head.weight"
            )

        def _weight_to_hf_format(self, mcore_weights_name, mcore_weights):
            names, tensors = super()._weight_to_hf_format(mcore_weights_name, mcore_weights)
            return [transformers5_name(n) for n in names], tensors  # fix 8

        def _get_mcore_config_by_name(self, mcore_weights_name: str):
            if mcore_weights_name.startswith("vision_model.projection."):  # fix 7
                return self.projection_config()
            return self.config

        def projection_config(self):
            """The merger's config, made once (before training hangs process groups on ``self.config``,
            which then no longer deep-copies)."""
            if getattr(self, "_projection_config", None) is None:
                self._projection_config = projection_config(self.config, self.hf_config.vision_config)
            return self._projection_config

        def _weight_name_mapping_other(self, name: str) -> list:
            parts = name.split(".")
            number, parts[3] = parts[3], "{layer_number}"
            key = ".".join(parts)
            if key not in norms:
                raise NotImplementedError(f"Unsupported parameter name: {name}")
            return [x.format(layer_number=number) for x in norms[key]]

        def _build_config(self):
            text = self.hf_config.text_config
            rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
            if getattr(text, "rope_theta", None) is None and "rope_theta" in rope:
                text.rope_theta = rope["rope_theta"]
            return self._build_base_config(
                text_config_key="text_config", add_qkv_bias=True, mrope_section=list(rope["mrope_section"])
            )

        def _model_provider(self, post_model_creation_callbacks):
            def provider(pre_process, post_process, vp_stage: Optional[int] = None):
                from megatron.core.models.gpt.gpt_layer_specs import (
                    get_gpt_decoder_block_spec,
                    get_gpt_layer_local_spec,
                )
                from megatron.core.models.gpt.moe_module_specs import MLPSubmodules
                from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
                from megatron.core.transformer.enums import AttnMaskType

                from rl_plugin.backends.megatron.compat.local_attention import VarlenDotProductAttention

                text, vc = self.hf_config.text_config, self.hf_config.vision_config
                block = get_gpt_decoder_block_spec(
                    self.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
                )
                block.layer_specs = [_layer_spec(s, VarlenDotProductAttention) for s in block.layer_specs]
                vit = _layer_spec(
                    get_gpt_layer_local_spec(normalization="RMSNorm"), VarlenFullAttention, AttnMaskType.no_mask
                )
                with _vl_attention():
                    model = model_class(
                        language_transformer_config=self.config,
                        language_transformer_layer_spec=block,
                        language_vocab_size=text.vocab_size,
                        language_max_sequence_length=text.max_position_embeddings,
                        vision_transformer_config=vision_config(self.config, vc),
                        vision_transformer_layer_spec=vit,
                        vision_projection_config=self.projection_config(),
                        vision_projection_layer_spec=MLPSubmodules(
                            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                        ),
                        vision_projection_type="mlp",
                        language_rotary_base=text.rope_theta,
                        pre_process=pre_process,
                        post_process=post_process,
                        add_decoder=True,
                        add_encoder=True,
                        parallel_output=True,
                        language_share_embeddings_and_output_weights=bool(getattr(text, "tie_word_embeddings", False)),
                        image_token_id=self.hf_config.image_token_id,
                        video_token_id=self.hf_config.video_token_id,
                    )
                for callback in post_model_creation_callbacks:
                    callback(
                        model,
                        pre_process=pre_process,
                        post_process=post_process,
                        config=self.config,
                        hf_config=self.hf_config,
                    )
                return model

            return provider

    LocalSpecVLBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecVLBridge
