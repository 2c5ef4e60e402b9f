"""The LoRA files of Flux.1 (:data:`FLUX`), as data.

How their keys name the models:

- diffusers / PEFT and ai-toolkit: ``transformer.<diffusers name>.lora_A.weight`` (``lora_B.bias`` too; stray
  ``.alpha`` keys are read), ``text_encoder.`` (CLIP), ``text_encoder_2.`` (T5); a bare PEFT transformer.
- kohya sd-scripts: ``lora_unet_`` + Black Forest Labs' names with underscores (``double_blocks_0_img_attn_qkv``:
  one adapter over the fused q, k, v; ``single_blocks_0_linear1``: q, k, v and the MLP's input), ``lora_te1_``
  (CLIP), ``lora_te3_`` (T5); OneTrainer's ``lora_transformer_`` + diffusers names with underscores.
- ComfyUI / BFL: BFL's dotted names under ``diffusion_model.`` (or none), ``lora_up`` / ``lora_down`` or
  ``lora_A`` / ``lora_B``; fal's Kontext trainer: BFL's names under ``base_model.model.`` (diffusers'
  ``_convert_fal_kontext_lora_to_diffusers``).
- XLabs: ``double_blocks.N.processor.qkv_lora1`` (image q, k, v), ``qkv_lora2`` (text), ``proj_lora1`` /
  ``proj_lora2`` (outputs), ``single_blocks.N.processor.qkv_lora`` (the q, k, v rows of ``linear1``) and
  ``proj_lora`` (``linear2``).

BFL's names are the single-file layout's (:func:`eqxdiff.loading.formats.flux_bfl`): an adapter over a fused BFL
tensor is cut into the separate layers (or kept whole on a model with ``fused_projections``), the final layer's
(shift, scale) rows swapped into diffusers' order, as the single-file rules do for the weights.
"""

from ..loading import formats, inverse
from ..loading.lora import NameLayout, Naming
from ._lora_format import LoraFormat

XLABS_ALIASES = (
    ("double_blocks.{i}.processor.qkv_lora1", "double_blocks.{i}.img_attn.qkv"),
    ("double_blocks.{i}.processor.qkv_lora2", "double_blocks.{i}.txt_attn.qkv"),
    ("double_blocks.{i}.processor.proj_lora1", "double_blocks.{i}.img_attn.proj"),
    ("double_blocks.{i}.processor.proj_lora2", "double_blocks.{i}.txt_attn.proj"),
    ("single_blocks.{i}.qkv", "single_blocks.{i}.linear1"),  # processor.qkv_lora: the q, k, v rows of linear1
    ("single_blocks.{i}.proj", "single_blocks.{i}.linear2"),
)
BFL = NameLayout("bfl", lambda transformer: inverse(formats.flux_bfl()), aliases=XLABS_ALIASES,
                 label="Black Forest Labs")

FLUX = LoraFormat(
    family="Flux.1",
    namings=(
        Naming("transformer.", "transformer", label="diffusers/PEFT"),
        Naming("lora_unet_", "transformer", "bfl", underscored=True, label="kohya (BFL names)"),
        Naming("lora_transformer_", "transformer", underscored=True, label="OneTrainer"),
        Naming("lycoris_", "transformer", underscored=True, label="LyCORIS (SimpleTuner)"),
        Naming("diffusion_model.", "transformer", "bfl", label="ComfyUI / BFL"),
        Naming("base_model.model.", "transformer", label="PEFT"),
        Naming("base_model.model.", "transformer", "bfl", label="fal (Kontext trainer, BFL names)"),
        Naming("", "transformer", "bfl", label="BFL / XLabs"),
        Naming("", "transformer", label="PEFT (transformer only)"),
        Naming("text_encoder.", "text_encoder", label="diffusers/PEFT"),
        Naming("lora_te1_", "text_encoder", underscored=True, label="kohya"),
        Naming("text_encoder_2.", "text_encoder_2", label="diffusers/PEFT"),
        Naming("lora_te3_", "text_encoder_2", underscored=True, label="kohya"),
    ),
    layouts=(BFL,),
    fuse_components=("transformer",),  # diffusers' FluxPipeline.fuse_lora(): a text encoder's adapters stay unfused
    # diffusers' names are Flux's by its blocks' layers (``attn``, ``ff_context``, ``norm1_context``), not by the
    # ``transformer.`` prefix alone: Wan's and LTX-Video's diffusers files carry it too
    markers=(r"^lora_transformer_",
             r"^(transformer\.|base_model\.model\.)?transformer_blocks\.\d+\.(attn|ff_context|norm1|norm1_context)\.",
             r"(^|[._])(double|single)_blocks[._]\d",
             r"single_transformer_blocks[._]\d", r"(^|[._])(x_embedder|context_embedder|img_in|txt_in)[._]",
             r"^lora_te3_"),
)

__all__ = ["BFL", "FLUX", "XLABS_ALIASES"]
