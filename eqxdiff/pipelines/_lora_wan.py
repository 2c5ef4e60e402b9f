"""The LoRA files of Wan 2.1 / 2.2 (:data:`WAN`), as data: ``WanPipeline.LORA_FORMAT`` (and so
``WanImageToVideoPipeline``'s).

How their keys name the transformer:

- diffusers / PEFT: ``transformer.<diffusers name>.lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias``, the
  metadata's alphas), or a bare PEFT transformer.
- The original names (Wan-AI's, ComfyUI's, diffusion-pipe's, ai-toolkit's Wan exports, lightx2v's):
  ``diffusion_model.blocks.N.self_attn.q``, ``cross_attn.k_img`` (image-to-video), ``ffn.0``, ``time_projection.1``,
  ``head.head`` ..., with ``lora_down`` / ``lora_up`` or ``lora_A`` / ``lora_B`` and ``.alpha`` (or no prefix).
- musubi-tuner: ``lora_unet_`` + the original names with underscores (``lora_unet_blocks_0_cross_attn_k_img``).
- lightx2v's distillation LoRAs (StepDistill / CfgDistill, Wan2.2-Lightning ...): LoRA pairs plus whole differences,
  ``.diff`` (a weight: ``head.head``, a norm's scale), ``.diff_b`` (a bias) and ``<block>.diff_m`` (the block's
  modulation table, ``blocks.N.modulation``, and ``head.diff_m`` the output head's). The norms' and tables'
  differences land in those layers' adapter slots, so they switch and scale like the LoRAs (diffusers drops them).

The original names are the single-file layout's (:func:`eqxdiff.loading.formats.wan_transformer`, inverted): no
second table. A LoRA for text-to-video loads into an image-to-video model as it is, its added k/v projections
unchanged (diffusers' ``_maybe_expand_t2v_lora_for_i2v`` pads them with zero LoRAs to the same effect). Files name
one transformer: a Wan 2.2 A14B pipeline's ``transformer`` (the high-noise expert) takes them, and
``load_lora_weights(file, load_into_transformer_2=True)`` (diffusers' keyword) loads one into ``transformer_2``, the
low-noise expert.
"""

from ..loading import formats, inverse
from ..loading.lora import NameLayout, Naming
from ._lora_format import LoraFormat

# lightx2v's diff_m names the block (or head) whose modulation table it changes: the table's original name.
MODULATION_ALIASES = (("blocks.{i}", "blocks.{i}.modulation"), ("head", "head.modulation"))
ORIGINAL = NameLayout("wan", lambda transformer: inverse(formats.wan_transformer()), aliases=MODULATION_ALIASES,
                      label="Wan (original names)")

WAN = LoraFormat(
    family="Wan",
    namings=(
        Naming("transformer.", "transformer", label="diffusers/PEFT"),
        Naming("diffusion_model.", "transformer", "wan", label="original / ComfyUI / diffusion-pipe / lightx2v"),
        Naming("lora_unet_", "transformer", "wan", underscored=True, label="musubi-tuner"),
        Naming("base_model.model.", "transformer", label="PEFT"),
        Naming("", "transformer", "wan", label="original names"),
        Naming("", "transformer", label="PEFT (transformer only)"),
    ),
    layouts=(ORIGINAL,),
    markers=(r"^(transformer\.|diffusion_model\.|lora_unet_|base_model\.model\.)?blocks[._]\d+[._]"
             r"(self_attn|cross_attn|attn1|attn2|ffn|norm3|modulation|diff_m)",
             r"(^|[._])((time|text)_embedding[._][02]|time_projection[._]1|img_emb[._]proj|condition_embedder)[._]"),
)

__all__ = ["MODULATION_ALIASES", "ORIGINAL", "WAN"]
