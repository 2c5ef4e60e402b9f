"""The LoRA files of LTX-Video (:data:`LTX`): ``LTXPipeline.LORA_FORMAT`` (and so its image-to-video and condition
pipelines').

How their keys name the transformer:

- diffusers / PEFT: ``transformer.<diffusers name>.lora_A.weight`` / ``lora_B.weight`` (the metadata's alphas), or
  a bare PEFT transformer (``base_model.model.`` or no prefix).
- Lightricks' trainer (LTX-Video-Trainer) and ComfyUI: ``diffusion_model.`` + the original transformer's names,
  which are diffusers' but for ``patchify_proj`` (``proj_in``), ``adaln_single`` (``time_embed``) and each
  attention's ``q_norm`` / ``k_norm``; diffusers' ``_convert_non_diffusers_ltxv_lora_to_diffusers`` only strips the
  prefix, so the diffusers names read there too.

The original names are the single-file layout's (:func:`eqxdiff.loading.formats.ltx_transformer`, inverted): no
second table.
"""

from ..loading import formats, inverse
from ..loading.lora import NameLayout, Naming
from ._lora_format import LoraFormat

ORIGINAL = NameLayout("ltx", lambda transformer: inverse(formats.ltx_transformer()), label="LTX-Video (original names)")

LTX = LoraFormat(
    family="LTX-Video",
    namings=(
        Naming("transformer.", "transformer", label="diffusers/PEFT"),
        Naming("diffusion_model.", "transformer", "ltx", label="LTX-Video-Trainer / ComfyUI"),
        Naming("diffusion_model.", "transformer", label="LTX-Video-Trainer / ComfyUI (diffusers names)"),
        Naming("base_model.model.", "transformer", label="PEFT"),
        Naming("", "transformer", "ltx", label="original names"),
        Naming("", "transformer", label="PEFT (transformer only)"),
    ),
    layouts=(ORIGINAL,),
    markers=(r"^(transformer\.|diffusion_model\.|base_model\.model\.)?transformer_blocks\.\d+\.(attn[12]|ff)\.",
             (r"^(transformer\.|diffusion_model\.|base_model\.model\.)?(patchify_proj|adaln_single|caption_projection"
              r"|time_embed)\.")),
)

__all__ = ["LTX", "ORIGINAL"]
