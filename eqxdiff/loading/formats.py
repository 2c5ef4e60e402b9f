"""Conversion rules for checkpoint formats other than diffusers/transformers folders, as data.

Pass them to ``eqxdiff.load(..., conversion=...)``; compose them with ``*``:

>>> from eqxdiff.loading import formats
>>> eqxdiff.load("sd_xl_base_1.0.safetensors", model_class="CLIPTextModelWithProjection",
...              config="stabilityai/stable-diffusion-xl-base-1.0", subfolder="text_encoder_2",
...              conversion=[*formats.select("conditioner.embedders.1.model."), *formats.openclip_text()])

Each rule set converts to the names eqxdiff reads and, through :func:`eqxdiff.loading.inverse`, back.
"""

import dataclasses
import os
from collections.abc import Mapping

from ._convert import Dim, Drop, Rename, Rule, Split, SwapHalves, Transpose
from ._errors import CheckpointError
from ._layout import Part, Stored
from ._ltx_formats import LTX_DIFFUSION_MODEL as LTX_DIFFUSION_MODEL
from ._ltx_formats import LTX_VAE as LTX_VAE
from ._ltx_formats import ltx_transformer as ltx_transformer
from ._ltx_formats import ltx_vae as ltx_vae
from ._rules import select as select
from ._safetensors import SafetensorsFile

# Where single-file checkpoints keep their text encoders (diffusers' single_file_utils reads the same prefixes).
SD1_CLIP = "cond_stage_model.transformer."  # A1111 / LDM Stable Diffusion 1.x: transformers' CLIP names below it
SD2_OPENCLIP = "cond_stage_model.model."  # Stable Diffusion 2.x: OpenCLIP ViT-H names below it
SDXL_CLIP = "conditioner.embedders.0.transformer."  # SDXL (SGM): transformers' CLIP ViT-L names
SDXL_OPENCLIP = "conditioner.embedders.1.model."  # SDXL (SGM): OpenCLIP bigG names
COMFY_T5XXL = "text_encoders.t5xxl.transformer."  # ComfyUI all-in-one Flux/SD3 files: transformers' T5 names
FLUX_DIFFUSION_MODEL = "model.diffusion_model."  # ComfyUI / fp8 repackagings of Flux: BFL's names below it


def openclip_text(*, projection: bool = True) -> tuple[Rule, ...]:
    """OpenCLIP's text tower (``open_clip`` state dicts, SD 2.x / SDXL single files below their prefix) as
    transformers' ``CLIPTextModelWithProjection`` (``projection=False``: ``CLIPTextModel``, the projection dropped).

    OpenCLIP fuses each layer's q/k/v into ``attn.in_proj_weight`` / ``in_proj_bias`` (equal thirds, in that
    order), stores ``text_projection`` as the matrix it multiplies by (``x @ P``: a ``Linear`` weight transposed)
    and the position table as a bare ``positional_embedding`` parameter.
    """
    layer, ours = "transformer.resblocks.{i}.", "text_model.encoder.layers.{i}."
    rules: list[Rule] = [Drop(("logit_scale", "visual.{name}"), optional=True)]
    for kind in ("weight", "bias"):
        rules.append(Split(layer + f"attn.in_proj_{kind}",
                           tuple(ours + f"self_attn.{p}_proj.{kind}" for p in "qkv")))
    for theirs, name in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
        rules.append(Rename(layer + theirs + ".{p}", ours + name + ".{p}"))
    rules += [Rename("token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
              Rename("positional_embedding", "text_model.embeddings.position_embedding.weight"),
              Rename("ln_final.{p}", "text_model.final_layer_norm.{p}")]
    rules.append(Transpose("text_projection", target="text_projection.weight") if projection
                 else Drop("text_projection", optional=True))
    return tuple(rules)


def flux_bfl(*, prefix: str = "") -> tuple[Rule, ...]:
    """Black Forest Labs' Flux.1 transformer files (``flux1-dev.safetensors``, ``flux1-schnell.safetensors`` and
    float8 repackagings; ``prefix``: where an all-in-one file keeps them, e.g. :data:`FLUX_DIFFUSION_MODEL`) as
    diffusers' ``FluxTransformer2DModel``: the mapping of diffusers'
    ``convert_flux_transformer_checkpoint_to_diffusers``, as rules.

    >>> eqxdiff.load("flux1-dev.safetensors", model_class="FluxTransformer2DModel",
    ...              config="black-forest-labs/FLUX.1-dev", subfolder="transformer", conversion=formats.flux_bfl())

    BFL fuses each double block's ``qkv`` (equal thirds) and each single block's ``linear1`` (queries, keys and values
    of the model width, then the MLP's input); the widths are read from the tensors (diffusers' converter assumes
    3072), so any size converts. The final layer's modulation is stored (shift, scale), diffusers' (scale, shift).
    The guidance embedder (``guidance_in``, dev only) is optional. The inverse writes BFL's layout back.
    """
    double, single, blocks, singles = "double_blocks.{i}.", "single_blocks.{i}.", "transformer_blocks.{i}.", \
        "single_transformer_blocks.{i}."
    rules: list[Rule] = list(select(prefix)) if prefix else []
    for theirs, ours in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                         ("guidance_in", "guidance_embedder")):
        for a, b in (("in_layer", "linear_1"), ("out_layer", "linear_2")):
            rules.append(Rename(f"{theirs}.{a}.{{p}}", f"time_text_embed.{ours}.{b}.{{p}}",
                                optional=theirs == "guidance_in"))
    rules += [Rename("txt_in.{p}", "context_embedder.{p}"), Rename("img_in.{p}", "x_embedder.{p}")]
    # double-stream blocks: image (img_*) and text (txt_*) streams
    for stream, mod, names, norms, proj, mlp in (
            ("img", "norm1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
            ("txt", "norm1_context", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"),
             "to_add_out", "ff_context")):
        rules += [Rename(f"{double}{stream}_mod.lin.{{p}}", f"{blocks}{mod}.linear.{{p}}"),
                  Split(f"{double}{stream}_attn.qkv.{{p}}", tuple(f"{blocks}attn.{n}.{{p}}" for n in names)),
                  Rename(f"{double}{stream}_attn.norm.query_norm.scale", f"{blocks}attn.{norms[0]}.weight"),
                  Rename(f"{double}{stream}_attn.norm.key_norm.scale", f"{blocks}attn.{norms[1]}.weight"),
                  Rename(f"{double}{stream}_attn.proj.{{p}}", f"{blocks}attn.{proj}.{{p}}"),
                  Rename(f"{double}{stream}_mlp.0.{{p}}", f"{blocks}{mlp}.net.0.proj.{{p}}"),
                  Rename(f"{double}{stream}_mlp.2.{{p}}", f"{blocks}{mlp}.net.2.{{p}}")]
    # single-stream blocks: linear1 = [q; k; v; mlp], each of q, k, v as wide as the model (linear1's input). The
    # bias is cut first, sized by the weight (which the inverse has joined again by then).
    for kind, width in (("bias", Dim(1, f"{single}linear1.weight")), ("weight", Dim(1))):
        rules.append(Split(f"{single}linear1.{kind}", (*(f"{singles}attn.to_{p}.{kind}" for p in "qkv"),
                                                       f"{singles}proj_mlp.{kind}"), sizes=(width, width, width, -1)))
    rules += [Rename(f"{single}linear2.{{p}}", f"{singles}proj_out.{{p}}"),
              Rename(f"{single}modulation.lin.{{p}}", f"{singles}norm.linear.{{p}}"),
              Rename(f"{single}norm.query_norm.scale", f"{singles}attn.norm_q.weight"),
              Rename(f"{single}norm.key_norm.scale", f"{singles}attn.norm_k.weight"),
              Rename("final_layer.linear.{p}", "proj_out.{p}"),
              SwapHalves("final_layer.adaLN_modulation.1.{p}", target="norm_out.linear.{p}")]
    return tuple(rules)


FLUX_AXES_DIMS_ROPE = {128: (16, 56, 56)}  # FLUX.1's split of a head's channels between the three position axes


def flux_bfl_config(path: str | os.PathLike, *, prefix: str = "",
                    axes_dims_rope: tuple[int, ...] | None = None) -> dict:
    """The diffusers config.json of the Flux transformer in a Black Forest Labs file, read from its tensors' names
    and shapes (no download): block counts, widths, head size, input/output channels, whether it embeds guidance.
    ``axes_dims_rope`` is not stored in the file: FLUX.1's ``(16, 56, 56)`` for heads of 128, else give it.
    ``patch_size`` is 1: the file holds only ``proj_out``'s width, ``patch_size ** 2 * out_channels`` (the same
    tensors either way).

    >>> rules = formats.flux_bfl()
    >>> eqxdiff.load("flux1-schnell.safetensors", model_class="FluxTransformer2DModel",
    ...              config=formats.flux_bfl_config("flux1-schnell.safetensors"), conversion=rules)
    """
    return bfl_config(SafetensorsFile(path), where=repr(os.fspath(path)), prefix=prefix,
                      axes_dims_rope=axes_dims_rope)


def bfl_config(view, *, where: str, prefix: str = "", axes_dims_rope: tuple[int, ...] | None = None) -> dict:
    """:func:`flux_bfl_config` of the file ``view`` (``where`` names it in errors)."""
    t = Stored(view, prefix)

    def shape(name: str) -> tuple[int, ...]:
        if not t.has(name):
            raise CheckpointError(f"{where} holds no {prefix + name!r}: not a Black Forest Labs Flux.1 transformer "
                                  "file (or give its prefix=)")
        return t.shapes[name]

    width, in_channels = shape("img_in.weight")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0] if t.count("double_blocks") else \
        shape("single_blocks.0.norm.query_norm.scale")[0]
    if axes_dims_rope is None:
        if head_dim not in FLUX_AXES_DIMS_ROPE:
            raise CheckpointError(f"{where} has heads of {head_dim} channels; say how they split between the "
                                  "position axes: flux_bfl_config(..., axes_dims_rope=(...))")
        axes_dims_rope = FLUX_AXES_DIMS_ROPE[head_dim]
    out = shape("final_layer.linear.weight")[0]
    return {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": in_channels,
            "out_channels": None if out == in_channels else out, "num_layers": t.count("double_blocks"),
            "num_single_layers": t.count("single_blocks"), "attention_head_dim": head_dim,
            "num_attention_heads": width // head_dim, "joint_attention_dim": shape("txt_in.weight")[1],
            "pooled_projection_dim": shape("vector_in.in_layer.weight")[1],
            "guidance_embeds": t.has("guidance_in.in_layer.weight"), "axes_dims_rope": list(axes_dims_rope)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BflTransformer(Part):
    """A Black Forest Labs Flux.1 transformer as a single-file part (:func:`flux_bfl` under ``prefix``), its config
    read from the tensors (:func:`bfl_config`)."""

    name: str = "transformer"
    model_class: str = "FluxTransformer2DModel"

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        return flux_bfl(prefix=self.prefix)

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        try:
            return bfl_config(view, where=where, prefix=self.prefix)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; or pass config= a Flux folder holding {self.name}/config.json") from None


# -- Wan 2.1 / 2.2 ----------------------------------------------------------------------------------------------------

WAN_DIFFUSION_MODEL = "model.diffusion_model."  # ComfyUI's repackagings of Wan: the original names below it

# Original Wan names -> diffusers' (scripts/convert_wan_to_diffusers.py, single_file_utils'
# convert_wan_transformer_to_diffusers), per block, then for the whole model; "optional": only some models have it.
_WAN_BLOCK = (
    *((f"self_attn.{p}", f"attn1.{d}") for p, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))),
    *((f"cross_attn.{p}", f"attn2.{d}") for p, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))),
    ("self_attn.norm_q", "attn1.norm_q"), ("self_attn.norm_k", "attn1.norm_k"),
    ("cross_attn.norm_q", "attn2.norm_q"), ("cross_attn.norm_k", "attn2.norm_k"),
    ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
)
_WAN_BLOCK_OPTIONAL = (  # image-to-video's added k/v; the cross-attention norm (original norm3, diffusers' norm2)
    ("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
    ("cross_attn.norm_k_img", "attn2.norm_added_k"), ("norm3", "norm2"),
)
_WAN_MODEL = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("head.head", "proj_out"),
)
_WAN_IMAGE = tuple((f"img_emb.proj.{i}", f"condition_embedder.image_embedder.{d}")
                   for i, d in ((0, "norm1"), (1, "ff.net.0.proj"), (3, "ff.net.2"), (4, "norm2")))


def wan_transformer(*, prefix: str = "") -> tuple[Rule, ...]:
    """The original Wan 2.1 / 2.2 transformer files (the Wan-AI repositories' ``diffusion_pytorch_model*.safetensors``,
    ComfyUI's repackagings below ``prefix`` :data:`WAN_DIFFUSION_MODEL`) as diffusers' ``WanTransformer3DModel``:
    the mapping of diffusers' ``convert_wan_transformer_to_diffusers``, as rules.

    >>> eqxdiff.load("wan2.1_t2v_1.3B_bf16.safetensors", model_class="WanTransformer3DModel",
    ...              config="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", subfolder="transformer",
    ...              conversion=formats.wan_transformer(prefix=formats.WAN_DIFFUSION_MODEL))

    ``self_attn`` / ``cross_attn`` ``q, k, v, o, norm_q, norm_k`` are ``attn1`` / ``attn2``; image-to-video's
    ``k_img, v_img, norm_k_img`` the added k/v ``add_k_proj, add_v_proj, norm_added_k`` and ``img_emb.proj`` (and the
    first-last-frame ``img_emb.emb_pos``) the image embedder; ``modulation`` the ``scale_shift_table`` s. The
    original's affine cross-attention norm is ``norm3`` (its order: norm1, norm3, norm2), diffusers' ``norm2``: the
    other two hold no parameters. The inverse writes the original names back."""
    b = "blocks.{i}."  # the same block names on both sides
    rules: list[Rule] = list(select(prefix)) if prefix else []
    rules += [Rename(f"{b}{theirs}.{{p}}", f"{b}{ours}.{{p}}") for theirs, ours in _WAN_BLOCK]
    rules += [Rename(f"{b}{theirs}.{{p}}", f"{b}{ours}.{{p}}", optional=True) for theirs, ours in _WAN_BLOCK_OPTIONAL]
    rules += [Rename(f"{b}modulation", f"{b}scale_shift_table"), Rename("head.modulation", "scale_shift_table")]
    rules += [Rename(f"{theirs}.{{p}}", f"{ours}.{{p}}") for theirs, ours in _WAN_MODEL]
    rules += [Rename(f"{theirs}.{{p}}", f"{ours}.{{p}}", optional=True) for theirs, ours in _WAN_IMAGE]
    rules.append(Rename("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed", optional=True))
    return tuple(rules)


_WAN_RESIDUAL = (("residual.0.gamma", "norm1.gamma"), ("residual.2.{p}", "conv1.{p}"),
                 ("residual.3.gamma", "norm2.gamma"), ("residual.6.{p}", "conv2.{p}"))
_WAN_ATTENTION = (("norm.gamma", "norm.gamma"), ("to_qkv.{p}", "to_qkv.{p}"), ("proj.{p}", "proj.{p}"))


def _wan_vae_renames(theirs: str, ours: str, pairs, *, optional: bool = False) -> list[Rule]:
    return [Rename(f"{theirs}.{a}", f"{ours}.{b}", optional=optional) for a, b in pairs]


def wan_vae(*, num_res_blocks: int = 2, levels: int = 4, prefix: str = "") -> tuple[Rule, ...]:
    """The original Wan 2.1 VAE (``Wan2.1_VAE`` of the Wan-AI repositories as safetensors, ComfyUI's
    ``wan_2.1_vae.safetensors``; ``prefix`` where an all-in-one file keeps it) as diffusers' ``AutoencoderKLWan``:
    the mapping of diffusers' ``convert_wan_vae_to_diffusers``, for a VAE of ``levels`` levels (``len(dim_mult)``)
    with ``num_res_blocks`` (the released VAE: 4 and 2).

    The original's residual blocks are ``residual.{0,2,3,6}`` (norm, conv, norm, conv) and ``shortcut``; the
    middle ``middle.{0,1,2}``, the heads ``head.{0,2}``, the quant convs ``conv1`` / ``conv2``. The encoder's
    ``downsamples`` list is diffusers' ``down_blocks`` index for index; the decoder's ``upsamples`` is one flat list
    per level (``num_res_blocks + 1`` residual blocks, then the upsampler), diffusers' ``up_blocks.{level}.resnets``
    and ``upsamplers.0``. The inverse writes the original names back."""
    rules: list[Rule] = list(select(prefix)) if prefix else []
    rules += [Rename("conv1.{p}", "quant_conv.{p}"), Rename("conv2.{p}", "post_quant_conv.{p}")]
    for side in ("encoder", "decoder"):
        rules += [Rename(f"{side}.conv1.{{p}}", f"{side}.conv_in.{{p}}"),
                  Rename(f"{side}.head.0.gamma", f"{side}.norm_out.gamma"),
                  Rename(f"{side}.head.2.{{p}}", f"{side}.conv_out.{{p}}")]
        for theirs, ours in ((0, "resnets.0"), (2, "resnets.1")):
            rules += _wan_vae_renames(f"{side}.middle.{theirs}", f"{side}.mid_block.{ours}", _WAN_RESIDUAL)
        rules += _wan_vae_renames(f"{side}.middle.1", f"{side}.mid_block.attentions.0", _WAN_ATTENTION)
    down = ("encoder.downsamples.{i}", "encoder.down_blocks.{i}")
    rules += _wan_vae_renames(*down, _WAN_RESIDUAL, optional=True)
    rules += _wan_vae_renames(*down, (("shortcut.{p}", "conv_shortcut.{p}"), ("resample.1.{p}", "resample.1.{p}"),
                                      ("time_conv.{p}", "time_conv.{p}"), *_WAN_ATTENTION), optional=True)
    index = 0
    for level in range(levels):
        for r in range(num_res_blocks + 1):
            theirs, ours = f"decoder.upsamples.{index}", f"decoder.up_blocks.{level}.resnets.{r}"
            rules += _wan_vae_renames(theirs, ours, _WAN_RESIDUAL)
            rules += _wan_vae_renames(theirs, ours, (("shortcut.{p}", "conv_shortcut.{p}"),), optional=True)
            index += 1
        if level != levels - 1:
            theirs, ours = f"decoder.upsamples.{index}", f"decoder.up_blocks.{level}.upsamplers.0"
            rules.append(Rename(f"{theirs}.resample.1.{{p}}", f"{ours}.resample.1.{{p}}"))
            rules.append(Rename(f"{theirs}.time_conv.{{p}}", f"{ours}.time_conv.{{p}}", optional=True))
            index += 1
    return tuple(rules)
