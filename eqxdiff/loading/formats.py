"""Conversion rules for checkpoint formats other than diffusers/transformers folders, as data.

Pass them to ``eqxdiff.load(..., conversion=...)``; compose them with ``*``:

>>> from eqxdiff.loading import formats
>>> eqxdiff.load("sd_xl_base_1.0.safetensors", model_class="CLIPTextModelWithProjection",
...              config="stabilityai/stable-diffusion-xl-base-1.0", subfolder="text_encoder_2",
...              conversion=[*formats.select("conditioner.embedders.1.model."), *formats.openclip_text()])

Each rule set converts to the names eqxdiff reads and, through :func:`eqxdiff.loading.inverse`, back.
"""

from ._convert import Drop, Keep, Rename, Rule, Split, Transpose

# Where single-file checkpoints keep their text encoders (diffusers' single_file_utils reads the same prefixes).
SD1_CLIP = "cond_stage_model.transformer."  # A1111 / LDM Stable Diffusion 1.x: transformers' CLIP names below it
SD2_OPENCLIP = "cond_stage_model.model."  # Stable Diffusion 2.x: OpenCLIP ViT-H names below it
SDXL_CLIP = "conditioner.embedders.0.transformer."  # SDXL (SGM): transformers' CLIP ViT-L names
SDXL_OPENCLIP = "conditioner.embedders.1.model."  # SDXL (SGM): OpenCLIP bigG names
COMFY_T5XXL = "text_encoders.t5xxl.transformer."  # ComfyUI all-in-one Flux/SD3 files: transformers' T5 names


def select(prefix: str) -> tuple[Rule, ...]:
    """Only the tensors under ``prefix`` (one component of an all-in-one file), with the prefix removed. Written
    back, the prefix returns."""
    return (Keep(prefix + "{name}"), Rename(prefix + "{name}", "{name}"))


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
