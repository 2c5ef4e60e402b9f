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
from ._ltx_formats import LTX_STATISTICS as LTX_STATISTICS
from ._ltx_formats import LTX_UNUSED_STATISTICS as LTX_UNUSED_STATISTICS
from ._ltx_formats import LTX_VAE as LTX_VAE
from ._ltx_formats import ltx_unused_statistics as ltx_unused_statistics
from ._ltx_formats import ltx_transformer as ltx_transformer
from ._ltx_formats import ltx_vae as ltx_vae
from ._wan_formats import WAN22_LATENTS_MEAN as WAN22_LATENTS_MEAN
from ._wan_formats import WAN22_LATENTS_STD as WAN22_LATENTS_STD
from ._wan_formats import WAN_DIFFUSION_MODEL as WAN_DIFFUSION_MODEL
from ._wan_formats import WanTransformer as WanTransformer
from ._wan_formats import WanVae as WanVae
from ._wan_formats import wan_transformer as wan_transformer
from ._wan_formats import wan_transformer_config as wan_transformer_config
from ._wan_formats import wan_vae as wan_vae
from ._wan_formats import wan_vae_config as wan_vae_config
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
