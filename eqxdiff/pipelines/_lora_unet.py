"""The LoRA files of the UNet families (Stable Diffusion 1.x/2.x: :data:`SD`, SDXL: :data:`SDXL`), as data.

How their keys name the models:

- diffusers / PEFT: ``unet.<diffusers name>.lora_A.weight``, ``text_encoder.`` / ``text_encoder_2.<transformers
  name>``; older diffusers ``unet.<...>.processor.to_q_lora.down.weight`` and ``lora_linear_layer``; a bare PEFT
  UNet (``<diffusers name>.lora_A.weight``, ``base_model.model.`` ...).
- kohya / A1111 / civitai (and LyCORIS' LoCon, LoHa, LoKr, full diffs, ``dora_scale``): ``lora_unet_`` + the
  diffusers name with underscores, or the SGM/LDM name (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``,
  kohya's SDXL), ``lora_te_`` (SD 1.x/2.x), ``lora_te1_`` / ``lora_te2_`` (SDXL's two encoders); SimpleTuner's
  ``lycoris_`` prefix; ComfyUI's dotted SGM names under ``diffusion_model.``.

The SGM names are the single-file layout's (:func:`eqxdiff.loading.single_file.ldm_unet`, from the UNet's
config), so every UNet layout single files load in is one LoRA files may use. Per-block strengths
(``set_adapters(..., {"down": {"block_1": [0, 1]}, "mid": 0.5, "up": ...})``) follow diffusers'
``_maybe_expand_lora_scales``: a number per attention of a block, ResNets of a block at its attention's strength.
"""

import copy
from collections.abc import Callable, Mapping

from ..loading import inverse
from ..loading.lora import NameLayout, Naming
from ..loading.single_file import ldm_unet
from ._lora_format import LoraFormat

SGM = NameLayout("sgm", lambda unet: inverse(ldm_unet(unet.config, prefix="")), label="SGM / LDM")

UNET_NAMINGS = (
    Naming("unet.", "unet", label="diffusers/PEFT"),
    Naming("lora_unet_", "unet", underscored=True, label="kohya"),
    Naming("lora_unet_", "unet", "sgm", underscored=True, label="kohya (SGM names)"),
    Naming("lycoris_", "unet", underscored=True, label="LyCORIS (SimpleTuner)"),
    Naming("diffusion_model.", "unet", "sgm", label="ComfyUI (SGM names)"),
    Naming("base_model.model.", "unet", label="PEFT"),
    Naming("", "unet", label="PEFT (UNet only)"),
)
TEXT_NAMINGS = (
    Naming("text_encoder.", "text_encoder", label="diffusers/PEFT"),
    Naming("lora_te_", "text_encoder", underscored=True, label="kohya"),
    Naming("lora_te1_", "text_encoder", underscored=True, label="kohya"),
)
TEXT_2_NAMINGS = (
    Naming("text_encoder_2.", "text_encoder_2", label="diffusers/PEFT"),
    Naming("lora_te2_", "text_encoder_2", underscored=True, label="kohya"),
)


def _blocks(config) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The down / up blocks with attentions, and each block's number of layers (attentions)."""
    with_attention = {"down": [i for i, b in enumerate(config.down_blocks) if b.attention is not None],
                      "up": [i for i, b in enumerate(config.up_blocks) if b.attention is not None]}
    layers = {"down": [b.num_layers for b in config.down_blocks],
              "up": [len(b.skip_channels) for b in config.up_blocks]}
    return with_attention, layers


def _expand(spec: Mapping, with_attention, layers, default: float = 1.0) -> dict[str, float]:
    """diffusers' ``_maybe_expand_lora_scales_for_one_adapter``: ``{"down": ..., "mid": ..., "up": ...}`` as a
    strength per attention, by its diffusers name (``down_blocks.1.attentions.0``)."""
    unknown = sorted(set(spec) - {"down", "mid", "up"})
    if unknown:
        raise ValueError(f"per-block weights name {unknown}; give 'down', 'mid' and 'up' (e.g. {{'down': {{'block_1': "
                         "[0.0, 1.0]}, 'mid': 0.5, 'up': 1.0}})")
    scales = copy.deepcopy(dict(spec))
    mid = scales.pop("mid", default)
    if isinstance(mid, (list, tuple)):
        if len(mid) != 1:
            raise ValueError(f"per-block weights: 'mid' takes one value, got {len(mid)}")
        mid = mid[0]
    out = {"mid_block.attentions.0": float(mid)}
    for updown in ("down", "up"):
        value = scales.get(updown, default)
        blocks = value if isinstance(value, Mapping) else {f"block_{i}": value for i in with_attention[updown]}
        extra = sorted(set(blocks) - {f"block_{i}" for i in with_attention[updown]})
        if extra:
            raise ValueError(f"per-block weights: {updown} {extra} name blocks without attentions; this UNet's "
                             f"{updown} blocks with attentions are {[f'block_{i}' for i in with_attention[updown]]}")
        for i in with_attention[updown]:
            n = layers[updown][i]
            v = blocks.get(f"block_{i}", default)
            v = [v] * n if not isinstance(v, (list, tuple)) else list(v) * n if len(v) == 1 else list(v)
            if len(v) != n:
                raise ValueError(f"per-block weights: {updown}.block_{i} takes {n} values (one per attention), got "
                                 f"{len(v)}")
            for j, w in enumerate(v):
                out[f"{updown}_blocks.{i}.attentions.{j}"] = float(w)
    return out


def unet_block_scales(unet, spec: Mapping) -> Callable[[str], float]:
    """``module name -> strength`` for per-block weights ``spec`` (diffusers' ``get_module_weight``: the first
    attention whose name the module's contains, else the attention of the same index in the module's block, else
    1)."""
    expanded = _expand(spec, *_blocks(unet.config))

    def weight(module: str) -> float:
        for layer, value in expanded.items():
            if layer in module:
                return value
        parts = module.split(".")
        if len(parts) < 4:
            return 1.0
        return expanded.get(f"{parts[0]}.{parts[1]}.attentions.{parts[3]}", 1.0)

    return weight


SD = LoraFormat(
    family="Stable Diffusion 1.x/2.x",
    namings=UNET_NAMINGS + TEXT_NAMINGS,
    layouts=(SGM,),
    markers=(r"^lora_te_", r"down_blocks[._]0[._]attentions[._]", r"input_blocks[._][12][._]1[._]"),
    block_scales={"unet": unet_block_scales},
)
SDXL = LoraFormat(
    family="Stable Diffusion XL",
    namings=UNET_NAMINGS + TEXT_NAMINGS + TEXT_2_NAMINGS,
    layouts=(SGM,),
    markers=(r"^lora_te2_", r"^text_encoder_2\.", r"(^|[._])(add_embedding|label_emb)[._]",
             r"(attentions|input_blocks[._]\d+|output_blocks[._]\d+|middle_block)[._]\d+[._]"
             r"transformer_blocks[._][1-9]"),
    block_scales={"unet": unet_block_scales},
)

__all__ = ["SD", "SDXL", "SGM", "unet_block_scales"]
