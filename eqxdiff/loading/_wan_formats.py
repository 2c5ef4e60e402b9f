"""Wan 2.1 / 2.2's original checkpoints as conversion rules and single-file parts: the transformer of the Wan-AI
repositories (``diffusion_pytorch_model*.safetensors``, one file or shards; ComfyUI's repackagings below
``model.diffusion_model.``) and the VAE (``Wan2.1_VAE`` / ``Wan2.2_VAE`` as safetensors, ComfyUI's
``wan_2.1_vae.safetensors``), as diffusers' ``convert_wan_to_diffusers.py`` and ``single_file_utils`` rename them.
Re-exported by :mod:`eqxdiff.loading.formats`.

:class:`WanTransformer` and :class:`WanVae` are the single-file parts the Wan pipelines declare
(``eqxdiff.pipelines.wan.SINGLE_FILE_LAYOUTS``): their configs are read from the tensors
(:func:`wan_transformer_config`, :func:`wan_vae_config`) where the tensors show them, the rest from Wan's published
values (heads of 128 channels, eps 1e-6, the VAEs' latent statistics), or else from ``config=``.
"""

import dataclasses
import math
from collections.abc import Mapping

from ..models.wan_vae import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD
from ._convert import Rename, Rule
from ._layout import Part, Stored, cannot_infer
from ._rules import select

WAN_DIFFUSION_MODEL = "model.diffusion_model."  # ComfyUI's repackagings of Wan: the original names below it
WAN_HEAD_DIM = 128  # every released Wan transformer's head width (the tensors do not show the head count)
# Wan2.2_VAE's latent statistics (diffusers' convert_wan_to_diffusers.py, vae22_diffusers_config)
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.1570,
    -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322,
    0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520,
    0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
    0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
    0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600,
    0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)
LATENT_STATISTICS = {16: (WAN21_LATENTS_MEAN, WAN21_LATENTS_STD), 48: (WAN22_LATENTS_MEAN, WAN22_LATENTS_STD)}

# -- the transformer --------------------------------------------------------------------------------------------------

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
    the mapping of diffusers' ``convert_wan_transformer_to_diffusers``, as rules. ``eqxdiff.load(file, config=...)``
    finds them by itself (the single-file part :class:`WanTransformer`); pass them to read such names explicitly:

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


def wan_transformer_config(view, *, where: str, prefix: str = "") -> dict:
    """The diffusers config.json of the original-named Wan transformer in ``view`` (a file's ``names()/shape()``,
    below ``prefix``), read from its tensors: the width and input channels (``patch_embedding``, whose kernel is the
    patch), output channels (``head.head``), layers, feed-forward, text and timestep widths, the cross-attention
    norm (``norm3``), image-to-video's image width (``img_emb``), added k/v (``k_img``) and first-last-frame positions
    (``img_emb.emb_pos``). What the tensors do not show is Wan's published value: heads of 128 channels, eps 1e-6,
    RMSNorm across heads, rotary tables over 1024 positions."""
    t = Stored(view, prefix)
    dim, in_channels, *patch = t.shape("patch_embedding.weight", where, "the patch embedding")
    patch_volume = math.prod(patch)
    out = t.shape("head.head.weight", where, "the output projection")[0]
    if len(patch) != 3 or out % patch_volume:
        raise cannot_infer(where, f"its patch embedding {tuple(patch)} and output projection ({out} rows) are not a "
                                  "Wan transformer's")
    if dim % WAN_HEAD_DIM:
        raise cannot_infer(where, f"its width {dim} is not a multiple of Wan's {WAN_HEAD_DIM}-channel heads, so the "
                                  "head count is unknown")
    if not t.has("blocks.0.self_attn.norm_q.weight"):
        raise cannot_infer(where, "its blocks have no QK norm (every released Wan model has one)")
    image = t.has("img_emb.proj.1.weight")
    return {"_class_name": "WanTransformer3DModel", "patch_size": list(patch),
            "num_attention_heads": dim // WAN_HEAD_DIM, "attention_head_dim": WAN_HEAD_DIM,
            "in_channels": in_channels, "out_channels": out // patch_volume,
            "text_dim": t.shape("text_embedding.0.weight", where)[1],
            "freq_dim": t.shape("time_embedding.0.weight", where)[1],
            "ffn_dim": t.shape("blocks.0.ffn.0.weight", where)[0], "num_layers": t.count("blocks"),
            "cross_attn_norm": t.has("blocks.0.norm3.weight"), "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
            "image_dim": t.shapes["img_emb.proj.1.weight"][1] if image else None,
            "added_kv_proj_dim": (t.shapes["blocks.0.cross_attn.k_img.weight"][1]
                                  if t.has("blocks.0.cross_attn.k_img.weight") else None),
            "rope_max_seq_len": 1024,
            "pos_embed_seq_len": t.shapes["img_emb.emb_pos"][1] if t.has("img_emb.emb_pos") else None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanTransformer(Part):
    """An original-named Wan transformer as a single-file part (:func:`wan_transformer` under ``prefix``), its config
    read from the tensors (:func:`wan_transformer_config`)."""

    name: str = "transformer"
    model_class: str = "WanTransformer3DModel"

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        return wan_transformer(prefix=self.prefix)

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        return wan_transformer_config(view, where=where, prefix=self.prefix)


# -- the VAE ----------------------------------------------------------------------------------------------------------

_RESIDUAL = (("residual.0.gamma", "norm1.gamma"), ("residual.2.{p}", "conv1.{p}"),
             ("residual.3.gamma", "norm2.gamma"), ("residual.6.{p}", "conv2.{p}"))
_SHORTCUT = (("shortcut.{p}", "conv_shortcut.{p}"),)
_ATTENTION = (("norm.gamma", "norm.gamma"), ("to_qkv.{p}", "to_qkv.{p}"), ("proj.{p}", "proj.{p}"))
_RESAMPLE = (("resample.1.{p}", "resample.1.{p}"),)
_TIME_CONV = (("time_conv.{p}", "time_conv.{p}"),)


def _renames(theirs: str, ours: str, pairs, *, optional: bool = False) -> list[Rule]:
    return [Rename(f"{theirs}.{a}", f"{ours}.{b}", optional=optional) for a, b in pairs]


def _wan21_levels(num_res_blocks: int, levels: int) -> list[Rule]:
    """Wan 2.1's level blocks: the encoder's ``downsamples`` is diffusers' ``down_blocks`` index for index (residual
    blocks and resamplers in one list); the decoder's ``upsamples`` one flat list per level (``num_res_blocks + 1``
    residual blocks, then the upsampler), diffusers' ``up_blocks.{level}.resnets`` and ``upsamplers.0``."""
    down = ("encoder.downsamples.{i}", "encoder.down_blocks.{i}")
    rules = _renames(*down, _RESIDUAL, optional=True)
    rules += _renames(*down, (*_SHORTCUT, *_RESAMPLE, *_TIME_CONV, *_ATTENTION), optional=True)
    index = 0
    for level in range(levels):
        for r in range(num_res_blocks + 1):
            theirs, ours = f"decoder.upsamples.{index}", f"decoder.up_blocks.{level}.resnets.{r}"
            rules += _renames(theirs, ours, _RESIDUAL) + _renames(theirs, ours, _SHORTCUT, optional=True)
            index += 1
        if level != levels - 1:
            theirs, ours = f"decoder.upsamples.{index}", f"decoder.up_blocks.{level}.upsamplers.0"
            rules += _renames(theirs, ours, _RESAMPLE) + _renames(theirs, ours, _TIME_CONV, optional=True)
            index += 1
    return rules


def _wan22_levels(num_res_blocks: int) -> list[Rule]:
    """Wan 2.2's level blocks, nested: ``encoder.downsamples.{i}.downsamples.{j}`` is diffusers'
    ``encoder.down_blocks.{i}.resnets.{j}`` (``j < num_res_blocks``) or, at ``j = num_res_blocks``, its
    ``downsampler``; ``decoder.upsamples.{i}.upsamples.{j}`` the same with ``num_res_blocks + 1`` residual blocks and
    the ``upsampler`` (diffusers' ``convert_vae_22``). The shortcuts that average or duplicate hold no weights."""
    rules: list[Rule] = []
    for side, blocks, resampler, n in (("encoder.downsamples", "encoder.down_blocks", "downsampler", num_res_blocks),
                                       ("decoder.upsamples", "decoder.up_blocks", "upsampler", num_res_blocks + 1)):
        inner = side.split(".")[1]
        resnet = (f"{side}.{{i}}.{inner}.{{j}}", f"{blocks}.{{i}}.resnets.{{j}}")
        rules += _renames(*resnet, _RESIDUAL) + _renames(*resnet, _SHORTCUT, optional=True)
        resample = (f"{side}.{{i}}.{inner}.{n}", f"{blocks}.{{i}}.{resampler}")
        rules += _renames(*resample, (*_RESAMPLE, *_TIME_CONV), optional=True)
    return rules


def wan_vae(*, num_res_blocks: int = 2, levels: int = 4, residual: bool = False, prefix: str = "") -> tuple[Rule, ...]:
    """The original Wan VAE (``Wan2.1_VAE`` of the Wan-AI repositories as safetensors, ComfyUI's
    ``wan_2.1_vae.safetensors``; ``residual``: Wan 2.2's ``Wan2.2_VAE``, whose levels nest their blocks; ``prefix``:
    where an all-in-one file keeps it) as diffusers' ``AutoencoderKLWan``: the mappings of diffusers'
    ``convert_wan_vae_to_diffusers`` (2.1) and ``convert_wan_to_diffusers.py``'s ``convert_vae_22`` (2.2), for a VAE
    of ``levels`` levels (``len(dim_mult)``) with ``num_res_blocks`` (the released VAEs: 4 and 2).

    The original's residual blocks are ``residual.{0,2,3,6}`` (norm, conv, norm, conv) and ``shortcut``; the
    middle ``middle.{0,1,2}``, the heads ``head.{0,2}``, the quant convs ``conv1`` / ``conv2``. The level blocks: see
    :func:`_wan21_levels` and :func:`_wan22_levels`. The inverse writes the original names back."""
    rules: list[Rule] = list(select(prefix)) if prefix else []
    rules += [Rename("conv1.{p}", "quant_conv.{p}"), Rename("conv2.{p}", "post_quant_conv.{p}")]
    for side in ("encoder", "decoder"):
        rules += [Rename(f"{side}.conv1.{{p}}", f"{side}.conv_in.{{p}}"),
                  Rename(f"{side}.head.0.gamma", f"{side}.norm_out.gamma"),
                  Rename(f"{side}.head.2.{{p}}", f"{side}.conv_out.{{p}}")]
        for theirs, ours in ((0, "resnets.0"), (2, "resnets.1")):
            rules += _renames(f"{side}.middle.{theirs}", f"{side}.mid_block.{ours}", _RESIDUAL)
        rules += _renames(f"{side}.middle.1", f"{side}.mid_block.attentions.0", _ATTENTION)
    rules += _wan22_levels(num_res_blocks) if residual else _wan21_levels(num_res_blocks, levels)
    return tuple(rules)


def _wan21_blocks(t: Stored, where: str) -> tuple[int, list[int], list[bool]]:
    """``(num_res_blocks, widths per level, temporal per downsampler)`` of a Wan 2.1 encoder's flat list."""
    kinds = [(k, t.has(f"encoder.downsamples.{k}.residual.0.gamma")) for k in t.indices("encoder.downsamples")]
    resamples = [k for k, residual in kinds if not residual]
    num_res = resamples[0] if resamples else len(kinds)
    if not num_res or len(kinds) % (num_res + 1) != num_res:
        raise cannot_infer(where, "its encoder's blocks are not levels of equal residual blocks and a downsampler")
    levels = (len(kinds) + 1) // (num_res + 1)
    widths = [t.shape(f"encoder.downsamples.{level * (num_res + 1)}.residual.2.weight", where)[0]
              for level in range(levels)]
    return num_res, widths, [t.has(f"encoder.downsamples.{k}.time_conv.weight") for k in resamples]


def _wan22_blocks(t: Stored, where: str) -> tuple[int, list[int], list[bool]]:
    """The same for Wan 2.2's nested levels."""
    levels = t.count("encoder.downsamples")
    num_res = sum(t.has(f"encoder.downsamples.0.downsamples.{j}.residual.0.gamma")
                  for j in t.indices("encoder.downsamples.0.downsamples"))
    widths = [t.shape(f"encoder.downsamples.{level}.downsamples.0.residual.2.weight", where)[0]
              for level in range(levels)]
    temporal = [t.has(f"encoder.downsamples.{level}.downsamples.{num_res}.time_conv.weight")
                for level in range(levels - 1)]
    return num_res, widths, temporal


def wan_vae_config(view, *, where: str, prefix: str = "") -> dict:
    """The diffusers config.json of the original-named Wan VAE in ``view`` (below ``prefix``), read from its tensors:
    2.1 or 2.2 (nested levels: ``is_residual``), the widths (``base_dim``, ``dim_mult``, the 2.2 decoder's
    ``decoder_base_dim``), residual blocks per level, which levels halve time, the latent channels and the pixels'
    patch (``in_channels`` 12 = 3 x 2 x 2). The latent statistics are the released VAEs' (2.1: z 16, 2.2: z 48)."""
    t = Stored(view, prefix)
    residual = any(n.startswith("encoder.downsamples.0.downsamples.") for n in t.names)
    base_dim, in_channels = t.shape("encoder.conv1.weight", where, "the encoder's first convolution")[:2]
    z_dim = t.shape("conv2.weight", where, "the post-quant convolution")[0]
    num_res, widths, temporal = (_wan22_blocks if residual else _wan21_blocks)(t, where)
    patch = math.isqrt(in_channels // 3)
    if 3 * patch * patch != in_channels or any(w % base_dim for w in widths):
        raise cannot_infer(where, f"its {in_channels} input channels and widths {widths} are not a Wan VAE's")
    dim_mult = [w // base_dim for w in widths]
    decoder_base = t.shape("decoder.conv1.weight", where)[0] // dim_mult[-1]
    if z_dim not in LATENT_STATISTICS:
        raise cannot_infer(where, f"it has {z_dim} latent channels, whose statistics (latents_mean / latents_std) "
                                  "only a config gives (Wan 2.1's VAE has 16, Wan 2.2's 48)")
    mean, std = LATENT_STATISTICS[z_dim]
    return {"_class_name": "AutoencoderKLWan", "base_dim": base_dim,
            "decoder_base_dim": None if decoder_base == base_dim else decoder_base, "z_dim": z_dim,
            "dim_mult": dim_mult, "num_res_blocks": num_res, "attn_scales": [], "temperal_downsample": temporal,
            "is_residual": residual, "in_channels": in_channels, "out_channels": t.shape("decoder.head.2.weight",
                                                                                       where)[0],
            "patch_size": None if patch == 1 else patch, "latents_mean": list(mean), "latents_std": list(std),
            "scale_factor_temporal": 2 ** sum(temporal), "scale_factor_spatial": 2 ** (len(widths) - 1) * patch}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanVae(Part):
    """An original-named Wan 2.1 or 2.2 VAE as a single-file part (:func:`wan_vae` under ``prefix``, its levels from
    the config), its config read from the tensors (:func:`wan_vae_config`)."""

    name: str = "vae"
    model_class: str = "AutoencoderKLWan"

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        return wan_vae(num_res_blocks=config.num_res_blocks, levels=len(config.dim_mult),
                       residual=config.is_residual, prefix=self.prefix)

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        return wan_vae_config(view, where=where, prefix=self.prefix)


__all__ = ["LATENT_STATISTICS", "WAN22_LATENTS_MEAN", "WAN22_LATENTS_STD", "WAN_DIFFUSION_MODEL", "WAN_HEAD_DIM",
           "WanTransformer", "WanVae", "wan_transformer", "wan_transformer_config", "wan_vae", "wan_vae_config"]
