"""The CompVis LDM / Stability SGM layouts of a UNet and a VAE (Stable Diffusion's single files) as diffusers'
``UNet2DConditionModel`` and ``AutoencoderKL``: conversion rules generated from a config (:func:`ldm_unet`,
:func:`ldm_vae`), configs inferred from the tensors (:func:`infer_unet_config`, :func:`infer_vae_config`), and the
layout parts that declare them with a family's published values (:class:`LdmUNet`, :class:`LdmVae`)."""

import dataclasses
import re
from collections.abc import Mapping

from ..models.unet2d import UNet2DConditionConfig
from ..models.vae import AutoencoderKLConfig
from ._convert import Dim, Drop, Rename, Reshape, Rule
from ._layout import Part, Stored, cannot_infer, heads
from ._rules import select

UNET = "model.diffusion_model."  # the LDM UNet of every SD 1.x / 2.x / SDXL single file
VAE = "first_stage_model."  # the LDM VAE

# -- the UNet ---------------------------------------------------------------------------------------------------------

_RESNET = (("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("emb_layers.1", "time_emb_proj"),
           ("out_layers.0", "norm2"), ("out_layers.3", "conv2"), ("skip_connection", "conv_shortcut"))


def _moved(theirs: str, ours: str) -> Rule:
    """Everything under ``theirs.`` is under ``ours.``."""
    return Rename(f"{theirs}.{{rest}}", f"{ours}.{{rest}}")


def ldm_unet(config: UNet2DConditionConfig, *, prefix: str = UNET) -> tuple[Rule, ...]:
    """The LDM/SGM UNet layout (``prefix``, default ``model.diffusion_model.``) as diffusers'
    ``UNet2DConditionModel`` of ``config``, the mapping of diffusers' ``convert_ldm_unet_checkpoint``.

    ``input_blocks`` number the down path's layers in one sequence: ``input_blocks.0`` is ``conv_in``, then for
    each block its ResNets (``.0``) with their transformers (``.1``) and a downsampler (``.0.op``);
    ``middle_block.{0,1,2}`` is ResNet, transformer, ResNet; ``output_blocks`` the up path's layers, the upsampler
    after the last layer's transformer (``.2.conv``, or ``.1.conv`` without one). Transformers keep their inner
    names; ResNets rename ``in_layers``/``emb_layers``/``out_layers``/``skip_connection``.
    """
    c = config
    rules: list[Rule] = [*select(prefix)]
    for theirs, ours in (("time_embed.0", "time_embedding.linear_1"), ("time_embed.2", "time_embedding.linear_2"),
                         ("input_blocks.0.0", "conv_in"), ("out.0", "conv_norm_out"), ("out.2", "conv_out")):
        rules.append(_moved(theirs, ours))
    if c.addition_embed_type == "text_time":
        rules += [_moved("label_emb.0.0", "add_embedding.linear_1"), _moved("label_emb.0.2", "add_embedding.linear_2")]
    k = 1
    for b, block in enumerate(c.down_blocks):
        for i in range(block.num_layers):
            rules.append(_moved(f"input_blocks.{k}.0", f"down_blocks.{b}.resnets.{i}"))
            if block.attention is not None:
                rules.append(_moved(f"input_blocks.{k}.1", f"down_blocks.{b}.attentions.{i}"))
            k += 1
        if block.downsample:
            rules.append(_moved(f"input_blocks.{k}.0.op", f"down_blocks.{b}.downsamplers.0.conv"))
            k += 1
    if c.mid_block is not None:
        rules.append(_moved("middle_block.0", "mid_block.resnets.0"))
        if c.mid_block.attention is not None:
            rules += [_moved("middle_block.1", "mid_block.attentions.0"),
                      _moved("middle_block.2", "mid_block.resnets.1")]
    k = 0
    for b, block in enumerate(c.up_blocks):
        layers = len(block.skip_channels)
        for i in range(layers):
            if i == layers - 1 and block.upsample:
                index = 2 if block.attention is not None else 1
                rules.append(_moved(f"output_blocks.{k}.{index}.conv", f"up_blocks.{b}.upsamplers.0.conv"))
            rules.append(_moved(f"output_blocks.{k}.0", f"up_blocks.{b}.resnets.{i}"))
            if block.attention is not None:
                rules.append(_moved(f"output_blocks.{k}.1", f"up_blocks.{b}.attentions.{i}"))
            k += 1
    for theirs, ours in _RESNET:  # inside every ResNet, named as above
        rules.append(Rename(f"{{block}}.resnets.{{i}}.{theirs}.{{p}}", f"{{block}}.resnets.{{i}}.{ours}.{{p}}",
                            optional=theirs == "skip_connection"))
    return tuple(rules)


def _depths(stored: Stored, head: str) -> int:
    return stored.count(f"{head}.transformer_blocks")


def _one_or_all(values: list):
    """One value if all are equal, else a tuple of them."""
    return values[0] if len(set(values)) == 1 else tuple(values)


def _down_path(t: Stored, where: str) -> tuple[list[int], list[list[int]]]:
    """The width of each down block and the transformer depth of each of its layers."""
    levels: list[list[tuple[int, int]]] = [[]]  # per down block: (width, transformer depth) of each layer
    for k in t.indices("input_blocks")[1:]:
        if t.has(f"input_blocks.{k}.0.op.weight"):
            levels.append([])
        else:
            width = t.shape(f"input_blocks.{k}.0.out_layers.3.weight", where, "a down-path ResNet")[0]
            levels[-1].append((width, _depths(t, f"input_blocks.{k}.1")))
    if any(not level for level in levels):
        raise cannot_infer(where, "the UNet's input_blocks do not alternate ResNets and downsamplers as an LDM "
                                  "UNet's do")
    widths = []
    for level in levels:
        if len({w for w, _ in level}) > 1:
            raise cannot_infer(where, f"a down block mixes widths {[w for w, _ in level]}")
        widths.append(level[0][0])
    return widths, [[d for _, d in level] for level in levels]


def _up_path(t: Stored) -> list[list[int]]:
    """The transformer depth of each layer of each up block."""
    ups: list[list[int]] = [[]]
    out_keys = t.indices("output_blocks")
    for j, k in enumerate(out_keys):
        ups[-1].append(_depths(t, f"output_blocks.{k}.1"))
        upsample = t.has(f"output_blocks.{k}.1.conv.weight") or t.has(f"output_blocks.{k}.2.conv.weight")
        if upsample and j < len(out_keys) - 1:
            ups.append([])
    return ups


def _transformer_depths(down: list[list[int]], ups: list[list[int]], mid_depth: int, where: str) -> dict:
    """``transformer_layers_per_block`` and ``reverse_transformer_layers_per_block`` of the depths found."""
    depths = {d for layers in down + ups + [[mid_depth]] for d in layers if d}
    shared = depths.pop() if len(depths) == 1 else 1
    n = len(down)

    def block_depths(level_depths: list[int], last: bool) -> int | tuple[int, ...]:
        if not any(level_depths):  # no attention: the depth every block shares (else 1), the mid block's for the last
            return mid_depth if last and mid_depth else shared
        if not all(level_depths):
            raise cannot_infer(where, f"a block has transformers in some layers only ({level_depths})")
        return _one_or_all(level_depths)

    tl = [block_depths(d, i == n - 1) for i, d in enumerate(down)]
    lpb = [len(level) for level in down]
    if len(ups) != n or [len(u) for u in ups] != [x + 1 for x in lpb[::-1]]:
        raise cannot_infer(where, f"the up path's layers {[len(u) for u in ups]} do not mirror the down path's "
                                  f"{lpb} (one more per block)")
    reverse = [block_depths(d, False) for d in ups]
    reverse_tl = tuple(reverse) if any(isinstance(d, tuple) for d in tl) or reverse != tl[::-1] else None
    last = tl[-1] if not isinstance(tl[-1], tuple) else tl[-1][0]
    if mid_depth and down[-1][0] and last != mid_depth:
        raise cannot_infer(where, f"the mid block's transformer depth {mid_depth} differs from the last block's "
                                  f"{last}, which diffusers' UNet2DConditionModel cannot express")
    return {"transformer_layers_per_block": tl[0] if len(set(tl)) == 1 else tl,
            "reverse_transformer_layers_per_block": reverse_tl}


def infer_unet_config(view, *, where: str, prefix: str = UNET, head_width: int | None = 64, sample_size: int = 64,
                      upcast_attention: bool = False, time_ids: int = 0, pooled_dim: int | None = None) -> dict:
    """A ``UNet2DConditionModel`` config.json (a dict) for the LDM UNet under ``prefix``.

    From the tensors: input/output channels and kernels, ``block_out_channels`` and ``layers_per_block`` (ResNets
    between downsamplers), block types (transformers present or not), transformer depth per block (per layer when
    it varies, with the up path's own depths when they differ), ``cross_attention_dim``, ``use_linear_projection``
    (``proj_in`` a matrix, not a 1x1 conv), the time-embedding width, SDXL's ``text_time`` embedding (``label_emb``)
    and ``addition_time_embed_dim`` (its input less ``pooled_dim``, over ``time_ids``).
    Given (a family's published values): attention heads (``head_width`` channels a head; ``None``: 8 per block, as
    SD 1.x), ``sample_size`` and ``upcast_attention``; 32 norm groups.
    """
    t = Stored(view, prefix)
    ch0, in_channels, kin, _ = t.shape("input_blocks.0.0.weight", where, "conv_in")
    out_channels, _, kout, _ = t.shape("out.2.weight", where, "conv_out")
    temb = t.shape("time_embed.0.weight", where, "the time embedding")[0]
    widths, down = _down_path(t, where)
    ups = _up_path(t)
    mid_depth = _depths(t, "middle_block.1")
    attention = [k for k in t.names if re.fullmatch(r".*\.transformer_blocks\.\d+\.attn2\.to_k\.weight", k)]
    proj_in = [k for k in t.names if k.endswith(".proj_in.weight")]
    config: dict = {
        "in_channels": in_channels, "out_channels": out_channels, "conv_in_kernel": kin, "conv_out_kernel": kout,
        "block_out_channels": widths, "layers_per_block": _one_or_all([len(level) for level in down]),
        "down_block_types": ["CrossAttnDownBlock2D" if any(d) else "DownBlock2D" for d in down],
        "up_block_types": ["CrossAttnUpBlock2D" if any(d) else "UpBlock2D" for d in ups],
        "mid_block_type": ("UNetMidBlock2DCrossAttn" if mid_depth else "UNetMidBlock2D")
        if t.has("middle_block.0.in_layers.0.weight") else None,
        **_transformer_depths(down, ups, mid_depth, where),
        "cross_attention_dim": t.shape(attention[0], where)[1] if attention else widths[-1],
        "use_linear_projection": bool(proj_in) and len(t.shape(proj_in[0], where)) == 2,
        "attention_head_dim": 8 if head_width is None else _one_or_all([heads(w, head_width) for w in widths]),
        "norm_num_groups": 32, "sample_size": sample_size, "upcast_attention": upcast_attention,
    }
    if temb != 4 * ch0:
        config["time_embedding_dim"] = temb
    if t.has("label_emb.0.0.weight"):
        features = t.shape("label_emb.0.0.weight", where)[1]
        if not time_ids or pooled_dim is None or (features - pooled_dim) % time_ids:
            raise cannot_infer(where, f"the UNet's class embedding (label_emb, {features} inputs) does not fit "
                                      f"{time_ids} time ids and the pooled text ({pooled_dim} wide)")
        config.update(addition_embed_type="text_time", projection_class_embeddings_input_dim=features,
                      addition_time_embed_dim=(features - pooled_dim) // time_ids)
    return config


@dataclasses.dataclass(frozen=True, kw_only=True)
class LdmUNet(Part):
    """The LDM UNet of a single file (:func:`ldm_unet`), its config inferred with the family's published values
    (:func:`infer_unet_config`): ``head_width`` channels a head (``None``: 8 heads a block), ``sample_size``,
    ``upcast_attention``, SDXL's ``time_ids`` micro-conditioning values and ``pooled_from``, the text encoder whose
    projection width the UNet's added embedding takes."""

    name: str = "unet"
    model_class: str = "UNet2DConditionModel"
    prefix: str = UNET
    head_width: int | None = 64
    sample_size: int = 64
    upcast_attention: bool = False
    time_ids: int = 0
    pooled_from: str | None = None

    @property
    def needs(self) -> tuple[str, ...]:
        return () if self.pooled_from is None else (self.pooled_from,)

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        return ldm_unet(config, prefix=self.prefix)

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        pooled = configs[self.pooled_from].projection_dim if self.pooled_from else None
        return infer_unet_config(view, where=where, prefix=self.prefix, head_width=self.head_width,
                                 sample_size=self.sample_size, upcast_attention=self.upcast_attention,
                                 time_ids=self.time_ids, pooled_dim=pooled)


# -- the VAE ----------------------------------------------------------------------------------------------------------


def ldm_vae(config: AutoencoderKLConfig, *, prefix: str = VAE) -> tuple[Rule, ...]:
    """The LDM VAE layout (``prefix``, default ``first_stage_model.``) as diffusers' ``AutoencoderKL`` of
    ``config``, the mapping of diffusers' ``convert_ldm_vae_checkpoint``: ``encoder.down.{i}.block.{j}`` ->
    ``encoder.down_blocks.{i}.resnets.{j}``; the decoder's ``up.{i}`` counted from the bottom (diffusers' up block
    ``n - 1 - i``); ``mid.block_{1,2}`` / ``mid.attn_1``; ``nin_shortcut`` -> ``conv_shortcut``, ``norm_out`` ->
    ``conv_norm_out``. The mid-block attention's ``q/k/v/proj_out`` are 1x1 convs ``[C, C, 1, 1]``, diffusers'
    ``to_q/to_k/to_v/to_out.0`` linear layers ``[C, C]`` (a reshape, undone when writing). A training loss's
    weights (``loss.*``), which some files keep, are dropped."""
    n, layers = len(config.block_out_channels), config.layers_per_block
    rules: list[Rule] = [*select(prefix), Drop("loss.{rest}", optional=True)]
    for side in ("encoder", "decoder"):
        rules.append(_moved(f"{side}.norm_out", f"{side}.conv_norm_out"))
        for j in (1, 2):
            rules.append(_moved(f"{side}.mid.block_{j}", f"{side}.mid_block.resnets.{j - 1}"))
        if config.mid_block_add_attention:
            theirs, ours = f"{side}.mid.attn_1", f"{side}.mid_block.attentions.0"
            rules.append(_moved(f"{theirs}.norm", f"{ours}.group_norm"))
            for conv, linear in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
                rules += [Reshape(f"{theirs}.{conv}.weight", (Dim(0), Dim(1)), target=f"{ours}.{linear}.weight",
                                  inverse_shape=(Dim(0), Dim(1), 1, 1)),
                          Rename(f"{theirs}.{conv}.bias", f"{ours}.{linear}.bias")]
    for i in range(n):
        for j in range(layers):
            rules.append(_moved(f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}"))
        if i < n - 1:
            rules.append(_moved(f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv"))
        level = n - 1 - i  # LDM counts the decoder's levels from the bottom
        for j in range(layers + 1):
            rules.append(_moved(f"decoder.up.{level}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}"))
        if i < n - 1:
            rules.append(_moved(f"decoder.up.{level}.upsample.conv", f"decoder.up_blocks.{i}.upsamplers.0.conv"))
    rules.append(Rename("{block}.resnets.{i}.nin_shortcut.{p}", "{block}.resnets.{i}.conv_shortcut.{p}",
                        optional=True))
    return tuple(rules)


def infer_vae_config(view, *, where: str, prefix: str = VAE, sample_size: int = 512,
                     scaling_factor: float = 0.18215) -> dict:
    """An ``AutoencoderKL`` config.json (a dict) for the LDM VAE under ``prefix``: channels, widths, layers per
    block, latent channels, quant convs and mid-block attention from the tensors; ``sample_size`` and
    ``scaling_factor`` given (a family's published values: SD 1.x/2.x 0.18215, SDXL 0.13025); 32 norm groups."""
    t = Stored(view, prefix)
    levels = t.indices("encoder.down")
    if not levels:
        raise cannot_infer(where, "the VAE has no encoder.down blocks")
    widths = [t.shape(f"encoder.down.{i}.block.0.conv2.weight", where, "an encoder ResNet")[0] for i in levels]
    return {
        "in_channels": t.shape("encoder.conv_in.weight", where, "the VAE's conv_in")[1],
        "out_channels": t.shape("decoder.conv_out.weight", where, "the VAE's conv_out")[0],
        "block_out_channels": widths, "down_block_types": ["DownEncoderBlock2D"] * len(widths),
        "up_block_types": ["UpDecoderBlock2D"] * len(widths), "layers_per_block": t.count("encoder.down.0.block"),
        "latent_channels": t.shape("decoder.conv_in.weight", where, "the decoder's conv_in")[1],
        "use_quant_conv": t.has("quant_conv.weight"), "use_post_quant_conv": t.has("post_quant_conv.weight"),
        "mid_block_add_attention": t.has("encoder.mid.attn_1.q.weight"), "norm_num_groups": 32,
        "sample_size": sample_size, "scaling_factor": scaling_factor,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class LdmVae(Part):
    """The LDM VAE of a single file (:func:`ldm_vae`), its config inferred (:func:`infer_vae_config`) with the
    family's published ``sample_size`` and ``scaling_factor`` (SD 1.x's by default)."""

    name: str = "vae"
    model_class: str = "AutoencoderKL"
    prefix: str = VAE
    sample_size: int = 512
    scaling_factor: float = 0.18215

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        return ldm_vae(config, prefix=self.prefix)

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        return infer_vae_config(view, where=where, prefix=self.prefix, sample_size=self.sample_size,
                                scaling_factor=self.scaling_factor)
