"""Single-file Stable Diffusion checkpoints (A1111 / ComfyUI / SGM ``.safetensors``) as conversion rules.

The files people download from model sites hold a whole pipeline in one ``.safetensors``, each model under its own
prefix and in the original (CompVis LDM / Stability SGM) names:

================================================  ===========================================================
``model.diffusion_model.``                         the UNet (``input_blocks``, ``middle_block``, ``output_blocks``)
``first_stage_model.``                             the VAE (``encoder.down.{i}.block.{j}``, 1x1-conv attention)
``cond_stage_model.transformer.``                  SD 1.x: CLIP ViT-L in transformers' names
``cond_stage_model.model.``                        SD 2.x: OpenCLIP ViT-H (its last block unused)
``conditioner.embedders.0.transformer.``           SDXL base: CLIP ViT-L in transformers' names
``conditioner.embedders.1.model.``                 SDXL base: OpenCLIP bigG (with its text projection)
``conditioner.embedders.0.model.``                 SDXL refiner: OpenCLIP bigG alone
================================================  ===========================================================

The UNet's and the VAE's layouts number their layers through the whole network, so the rules are generated from a
config (:func:`ldm_unet`, :func:`ldm_vae`); :func:`detect` finds the family of a file and the configs are inferred
from the tensors' names and shapes (:func:`infer_unet_config`, :func:`infer_vae_config`, :func:`infer_clip_config`).
What the tensors do not show is taken from the family's published configs (:data:`FAMILIES`): attention heads
(SD 1.x: 8 per block; SD 2.x and SDXL: 64 channels a head), group-norm groups (32), sample sizes, the VAE's scaling
factor, text-encoder heads (64 channels a head) and activations (quick-GELU for OpenAI's CLIP, GELU for OpenCLIP).
The rules' :func:`~eqxdiff.loading.inverse` writes a model back in the file's layout (:func:`layout_tensors`), so
eqxdiff writes files that diffusers' ``from_single_file`` reads. The pipeline-level entry is
``eqxdiff.load_pipeline("file.safetensors", config=...)``.
"""

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

from ..core import leaf_specs
from ..models.clip import CLIPTextConfig
from ..models.unet2d import UNet2DConditionConfig
from ..models.vae import AutoencoderKLConfig
from ._convert import Dim, Drop, Rename, Reshape, Rule, convert, convert_tensors, inverse
from ._errors import PICKLE_SUFFIXES as PICKLE_SUFFIXES
from ._errors import CheckpointError
from ._fill import state_dict
from .formats import SD1_CLIP, SD2_OPENCLIP, SDXL_CLIP, SDXL_OPENCLIP, openclip_text, select

UNET = "model.diffusion_model."  # the LDM UNet of every SD 1.x / 2.x / SDXL single file
VAE = "first_stage_model."  # the LDM VAE
SDXL_REFINER_OPENCLIP = "conditioner.embedders.0.model."  # the SDXL refiner's only text encoder (OpenCLIP bigG)

KNOWN_PREFIXES: Mapping[str, str] = {
    UNET: "UNet", VAE: "VAE", SD1_CLIP: "SD 1.x CLIP text encoder", SD2_OPENCLIP: "SD 2.x OpenCLIP text encoder",
    SDXL_CLIP: "SDXL CLIP text encoder", SDXL_OPENCLIP: "SDXL OpenCLIP text encoder",
    SDXL_REFINER_OPENCLIP: "SDXL refiner OpenCLIP text encoder",
}


# -- families ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    """One model of a single file: its pipeline component ``name``, checkpoint class, prefix and text-encoder
    ``kind`` (``"clip"``: transformers' names; ``"openclip"``; ``None`` for the UNet and the VAE)."""

    name: str
    model_class: str
    prefix: str
    kind: str | None = None


def _scheduler(class_name: str, **extra) -> dict:
    return {"_class_name": class_name, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "num_train_timesteps": 1000, "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False,
            "skip_prk_steps": True, "prediction_type": "epsilon", **extra}


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family's single files hold and, for what their tensors do not show, the values of the family's
    published diffusers configs (``hub_id``: where its tokenizers are fetched from without ``config=``)."""

    name: str
    text: tuple[Part, ...]
    pipeline: str
    inpaint_pipeline: str | None
    hub_id: str
    inpaint_hub_id: str | None
    head_width: int | None  # UNet heads = channels // head_width; None: 8 heads per block (SD 1.x)
    sample_size: int  # the UNet's (latents); the VAE's is 8x
    scaling_factor: float
    time_ids: int  # SDXL micro-conditioning values (6; the refiner 5: with the aesthetic score)
    scheduler: Mapping
    inpaint_scheduler: Mapping
    options: Mapping = dataclasses.field(default_factory=dict)
    upcast_attention: bool = False

    def parts(self) -> tuple[Part, ...]:
        return (*self.text, Part("unet", "UNet2DConditionModel", UNET), Part("vae", "AutoencoderKL", VAE))


_EULER = _scheduler("EulerDiscreteScheduler", interpolation_type="linear", timestep_spacing="leading",
                    use_karras_sigmas=False)
_SD = {"pipeline": "StableDiffusionPipeline", "inpaint_pipeline": "StableDiffusionInpaintPipeline", "sample_size": 64,
       "scaling_factor": 0.18215, "time_ids": 0}
_XL = {"head_width": 64, "sample_size": 128, "scaling_factor": 0.13025, "scheduler": _EULER, "inpaint_scheduler": _EULER}
FAMILIES: Mapping[str, Family] = {f.name: f for f in (
    Family("sd1", text=(Part("text_encoder", "CLIPTextModel", SD1_CLIP, "clip"),),
           hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5",
           inpaint_hub_id="stable-diffusion-v1-5/stable-diffusion-inpainting", head_width=None,
           scheduler=_scheduler("PNDMScheduler"), inpaint_scheduler=_scheduler("PNDMScheduler"), **_SD),
    Family("sd2", text=(Part("text_encoder", "CLIPTextModel", SD2_OPENCLIP, "openclip"),),
           hub_id="stabilityai/stable-diffusion-2-1", inpaint_hub_id="stabilityai/stable-diffusion-2-inpainting",
           head_width=64, scheduler=_scheduler("DDIMScheduler", prediction_type="v_prediction"),
           inpaint_scheduler=_scheduler("DDIMScheduler"), upcast_attention=True, **{**_SD, "sample_size": 96}),
    Family("sdxl", text=(Part("text_encoder", "CLIPTextModel", SDXL_CLIP, "clip"),
                         Part("text_encoder_2", "CLIPTextModelWithProjection", SDXL_OPENCLIP, "openclip")),
           pipeline="StableDiffusionXLPipeline", inpaint_pipeline="StableDiffusionXLInpaintPipeline",
           hub_id="stabilityai/stable-diffusion-xl-base-1.0",
           inpaint_hub_id="diffusers/stable-diffusion-xl-1.0-inpainting-0.1", time_ids=6,
           options={"force_zeros_for_empty_prompt": True}, **_XL),
    Family("sdxl_refiner", text=(Part("text_encoder_2", "CLIPTextModelWithProjection", SDXL_REFINER_OPENCLIP,
                                      "openclip"),),
           pipeline="StableDiffusionXLImg2ImgPipeline", inpaint_pipeline=None,
           hub_id="stabilityai/stable-diffusion-xl-refiner-1.0", inpaint_hub_id=None, time_ids=5,
           options={"requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False}, **_XL),
)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A single file's family, whether its UNet inpaints (9 input channels) and its models (:class:`Part`)."""

    family: Family
    inpainting: bool = False

    @property
    def parts(self) -> tuple[Part, ...]:
        return self.family.parts()

    @property
    def pipeline(self) -> str:
        return self.family.inpaint_pipeline if self.inpainting else self.family.pipeline

    @property
    def hub_id(self) -> str:
        return self.family.inpaint_hub_id if self.inpainting else self.family.hub_id

    @property
    def scheduler(self) -> dict:
        return dict(self.family.inpaint_scheduler if self.inpainting else self.family.scheduler)

    def rules(self, part: Part, config, view=None) -> tuple[Rule, ...]:
        """The conversion of ``part`` (built with ``config``) from the file's layout to eqxdiff's names. ``view``:
        the file, when reading it (an OpenCLIP tower may hold more blocks than the config uses)."""
        if part.name == "unet":
            return ldm_unet(config, prefix=part.prefix)
        if part.name == "vae":
            return ldm_vae(config, prefix=part.prefix)
        return text_rules(part, config, view)

    def infer(self, part: Part, view, *, where: str, pooled_dim: int | None = None) -> dict:
        """``part``'s config.json keys inferred from the file's tensors and the family's defaults."""
        if part.name == "unet":
            return infer_unet_config(view, self.family, where=where, pooled_dim=pooled_dim)
        if part.name == "vae":
            return infer_vae_config(view, self.family, where=where)
        return infer_clip_config(view, part, self.family, where=where)


def detect(view, where: str) -> Layout:
    """The :class:`Layout` of a single file (``view``: its ``names()/shape()``), or a :class:`CheckpointError`
    saying what it lacks."""
    names = view.names()
    present = {p for p in KNOWN_PREFIXES if any(n.startswith(p) for n in names)}
    if not present:
        raise CheckpointError(
            f"{where} is not in a single-file layout eqxdiff knows: no tensor name starts with any of "
            f"{', '.join(repr(p) for p in KNOWN_PREFIXES)} (it holds {_short(sorted(names), 4)}). A file of one model "
            "in diffusers' names loads with eqxdiff.load(file, model_class=..., config=...); other formats with "
            "conversion rules (eqxdiff.loading.formats)")
    if SDXL_OPENCLIP in present:
        family = FAMILIES["sdxl"]
    elif SDXL_REFINER_OPENCLIP in present:
        family = FAMILIES["sdxl_refiner"]
    elif SD2_OPENCLIP in present:
        family = FAMILIES["sd2"]
    elif SD1_CLIP in present:
        family = FAMILIES["sd1"]
    else:
        raise CheckpointError(
            f"{where} holds a {' and a '.join(KNOWN_PREFIXES[p] for p in sorted(present))} but no text encoder, so "
            f"it is not a whole pipeline; a UNet alone in this layout loads with eqxdiff.load(file, "
            "model_class='UNet2DConditionModel', config=unet_config, conversion=single_file.ldm_unet(unet_config))")
    for part in family.parts():
        if part.prefix not in present:
            raise CheckpointError(f"{where} looks like a {family.name} file but holds no {part.name} (no tensor "
                                  f"under {part.prefix!r}); the file is incomplete: download it again, or load its "
                                  "models one by one with eqxdiff.load(file, ..., conversion=...)")
    conv_in = _Stored(view, UNET).shape("input_blocks.0.0.weight", where, "the UNet's conv_in")
    return Layout(family, inpainting=conv_in[1] == 9 and family.inpaint_pipeline is not None)


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
            rules += [_moved("middle_block.1", "mid_block.attentions.0"), _moved("middle_block.2", "mid_block.resnets.1")]
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


def _depths(stored: "_Stored", head: str) -> int:
    return stored.count(f"{head}.transformer_blocks")


def _one_or_all(values: list):
    """One value if all are equal, else a tuple of them."""
    return values[0] if len(set(values)) == 1 else tuple(values)


def infer_unet_config(view, family: Family, *, where: str, prefix: str = UNET,
                      pooled_dim: int | None = None) -> dict:
    """A ``UNet2DConditionModel`` config.json (a dict) for the LDM UNet under ``prefix``.

    From the tensors: input/output channels and kernels, ``block_out_channels`` and ``layers_per_block`` (ResNets
    between downsamplers), block types (transformers present or not), transformer depth per block (per layer when
    it varies, with the up path's own depths when they differ), ``cross_attention_dim``, ``use_linear_projection``
    (``proj_in`` a matrix, not a 1x1 conv), the time-embedding width, SDXL's ``text_time`` embedding (``label_emb``)
    and ``addition_time_embed_dim`` (its input less ``pooled_dim``, over the family's number of time ids).
    From the family: attention heads (SD 1.x: 8 per block; SD 2.x / SDXL: one per 64 channels), 32 norm groups,
    ``sample_size`` and SD 2.x's ``upcast_attention``.
    """
    t = _Stored(view, prefix)
    ch0, in_channels, kin, _ = t.shape("input_blocks.0.0.weight", where, "conv_in")
    out_channels, _, kout, _ = t.shape("out.2.weight", where, "conv_out")
    temb = t.shape("time_embed.0.weight", where, "the time embedding")[0]

    levels: list[list[tuple[int, int]]] = [[]]  # per down block: (width, transformer depth) of each layer
    for k in t.indices("input_blocks")[1:]:
        if t.has(f"input_blocks.{k}.0.op.weight"):
            levels.append([])
        else:
            width = t.shape(f"input_blocks.{k}.0.out_layers.3.weight", where, "a down-path ResNet")[0]
            levels[-1].append((width, _depths(t, f"input_blocks.{k}.1")))
    if any(not level for level in levels):
        raise _cannot_infer(where, "the UNet's input_blocks do not alternate ResNets and downsamplers as an LDM "
                                   "UNet's do")
    widths = []
    for level in levels:
        if len({w for w, _ in level}) > 1:
            raise _cannot_infer(where, f"a down block mixes widths {[w for w, _ in level]}")
        widths.append(level[0][0])
    mid_depth = _depths(t, "middle_block.1")
    n = len(levels)
    down_depths = [[d for _, d in level] for level in levels]
    ups: list[list[int]] = [[]]  # per up block: transformer depth of each layer
    out_keys = t.indices("output_blocks")
    for j, k in enumerate(out_keys):
        ups[-1].append(_depths(t, f"output_blocks.{k}.1"))
        upsample = t.has(f"output_blocks.{k}.1.conv.weight") or t.has(f"output_blocks.{k}.2.conv.weight")
        if upsample and j < len(out_keys) - 1:
            ups.append([])
    depths = {d for layers in down_depths + ups + [[mid_depth]] for d in layers if d}
    shared = depths.pop() if len(depths) == 1 else 1

    def block_depths(level_depths: list[int], last: bool) -> int | tuple[int, ...]:
        if not any(level_depths):  # no attention: the depth every block shares (else 1), the mid block's for the last
            return mid_depth if last and mid_depth else shared
        if not all(level_depths):
            raise _cannot_infer(where, f"a block has transformers in some layers only ({level_depths})")
        return _one_or_all(level_depths)

    tl = [block_depths(d, i == n - 1) for i, d in enumerate(down_depths)]
    lpb = [len(level) for level in levels]
    if len(ups) != n or [len(u) for u in ups] != [x + 1 for x in lpb[::-1]]:
        raise _cannot_infer(where, f"the up path's layers {[len(u) for u in ups]} do not mirror the down path's "
                                   f"{lpb} (one more per block)")
    reverse = [block_depths(d, False) for d in ups]
    if any(isinstance(d, tuple) for d in tl) or reverse != tl[::-1]:
        reverse_tl = tuple(reverse)
    else:
        reverse_tl = None
    last = tl[-1] if not isinstance(tl[-1], tuple) else tl[-1][0]
    if mid_depth and down_depths[-1][0] and last != mid_depth:
        raise _cannot_infer(where, f"the mid block's transformer depth {mid_depth} differs from the last block's "
                                   f"{last}, which diffusers' UNet2DConditionModel cannot express")

    attention = [k for k in t.names if re.fullmatch(r".*\.transformer_blocks\.\d+\.attn2\.to_k\.weight", k)]
    proj_in = [k for k in t.names if k.endswith(".proj_in.weight")]
    config: dict = {
        "in_channels": in_channels, "out_channels": out_channels, "conv_in_kernel": kin, "conv_out_kernel": kout,
        "block_out_channels": widths, "layers_per_block": _one_or_all(lpb),
        "down_block_types": ["CrossAttnDownBlock2D" if any(d) else "DownBlock2D" for d in down_depths],
        "up_block_types": ["CrossAttnUpBlock2D" if any(d) else "UpBlock2D" for d in ups],
        "mid_block_type": ("UNetMidBlock2DCrossAttn" if mid_depth else "UNetMidBlock2D")
        if t.has("middle_block.0.in_layers.0.weight") else None,
        "transformer_layers_per_block": tl[0] if len(set(tl)) == 1 else tl,
        "reverse_transformer_layers_per_block": reverse_tl,
        "cross_attention_dim": t.shape(attention[0], where)[1] if attention else widths[-1],
        "use_linear_projection": bool(proj_in) and len(t.shape(proj_in[0], where)) == 2,
        "attention_head_dim": _unet_heads(widths, family),
        "norm_num_groups": 32, "sample_size": family.sample_size, "upcast_attention": family.upcast_attention,
    }
    if temb != 4 * ch0:
        config["time_embedding_dim"] = temb
    if t.has("label_emb.0.0.weight"):
        features = t.shape("label_emb.0.0.weight", where)[1]
        if not family.time_ids or pooled_dim is None or (features - pooled_dim) % family.time_ids:
            raise _cannot_infer(where, f"the UNet's class embedding (label_emb, {features} inputs) does not fit "
                                       f"{family.name}'s {family.time_ids} time ids and pooled text")
        config.update(addition_embed_type="text_time", projection_class_embeddings_input_dim=features,
                      addition_time_embed_dim=(features - pooled_dim) // family.time_ids)
    return config


def _unet_heads(widths: list[int], family: Family):
    if family.head_width is None:
        return 8
    return _one_or_all([_heads(w, family.head_width) for w in widths])


def _heads(width: int, head_width: int = 64) -> int:
    """``width // head_width`` heads if that divides ``width``, else one."""
    heads = width // head_width
    return heads if heads and width % heads == 0 else 1


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


def infer_vae_config(view, family: Family, *, where: str, prefix: str = VAE) -> dict:
    """An ``AutoencoderKL`` config.json (a dict) for the LDM VAE under ``prefix``: channels, widths, layers per
    block, latent channels, quant convs and mid-block attention from the tensors; 32 norm groups, the sample size
    and the scaling factor (SD 1.x/2.x 0.18215, SDXL 0.13025) from the family."""
    t = _Stored(view, prefix)
    levels = t.indices("encoder.down")
    if not levels:
        raise _cannot_infer(where, "the VAE has no encoder.down blocks")
    widths = [t.shape(f"encoder.down.{i}.block.0.conv2.weight", where, "an encoder ResNet")[0] for i in levels]
    return {
        "in_channels": t.shape("encoder.conv_in.weight", where, "the VAE's conv_in")[1],
        "out_channels": t.shape("decoder.conv_out.weight", where, "the VAE's conv_out")[0],
        "block_out_channels": widths, "down_block_types": ["DownEncoderBlock2D"] * len(widths),
        "up_block_types": ["UpDecoderBlock2D"] * len(widths), "layers_per_block": t.count("encoder.down.0.block"),
        "latent_channels": t.shape("decoder.conv_in.weight", where, "the decoder's conv_in")[1],
        "use_quant_conv": t.has("quant_conv.weight"), "use_post_quant_conv": t.has("post_quant_conv.weight"),
        "mid_block_add_attention": t.has("encoder.mid.attn_1.q.weight"), "norm_num_groups": 32,
        "sample_size": 8 * family.sample_size, "scaling_factor": family.scaling_factor,
    }


# -- text encoders ----------------------------------------------------------------------------------------------------


def clip_text(prefix: str, view=None) -> tuple[Rule, ...]:
    """A CLIP text encoder stored in transformers' names under ``prefix`` (read as ``CLIPTextModel``: a projection
    or logit scale some savers add is dropped); files from before transformers named the ``text_model`` wrapper
    (``view`` shows which) get it added."""
    rules = (*select(prefix), Drop(("text_projection.weight", "logit_scale"), optional=True))
    if view is not None and not any(n.startswith(prefix + "text_model.") for n in view.names()):
        rules = (*rules, Rename("{name}", "text_model.{name}"))
    return rules


def openclip_text_rules(prefix: str, config: CLIPTextConfig, *, projection: bool,
                        stored_layers: int = 0) -> tuple[Rule, ...]:
    """An OpenCLIP text tower under ``prefix`` (:func:`eqxdiff.loading.formats.openclip_text`) as transformers'
    ``CLIPTextModelWithProjection`` of ``config`` (``projection=False``: ``CLIPTextModel``). Blocks past
    ``config.num_hidden_layers`` (``stored_layers`` in the file) are dropped: SD 2.x files keep a last block that
    the pipeline never uses (it takes the penultimate layer)."""
    extra = tuple(f"transformer.resblocks.{i}.{{p}}" for i in range(config.num_hidden_layers, stored_layers))
    return (*select(prefix), *((Drop(extra),) if extra else ()), *openclip_text(projection=projection))


def text_rules(part: Part, config: CLIPTextConfig, view=None) -> tuple[Rule, ...]:
    """:meth:`Layout.rules` for a text encoder (``view``: the file, when reading it)."""
    if part.kind == "clip":
        return clip_text(part.prefix, view)
    stored = _Stored(view, part.prefix).count("transformer.resblocks") if view is not None else 0
    return openclip_text_rules(part.prefix, config, stored_layers=stored,
                               projection=part.model_class == "CLIPTextModelWithProjection")


def infer_clip_config(view, part: Part, family: Family, *, where: str) -> dict:
    """A CLIP text config.json (a dict) for ``part``'s tower: vocabulary, width, positions, depth, MLP width and
    projection from the tensors; 64 channels a head, quick-GELU (OpenAI's CLIP) or GELU (OpenCLIP), CLIP's
    tokenizer ids from the family. An SD 2.x tower's last block is left out (the pipeline takes the penultimate
    layer, as diffusers' SD 2.x text encoders do)."""
    t = _Stored(view, part.prefix)
    if part.kind == "clip":
        base = "text_model." if t.has("text_model.embeddings.token_embedding.weight") else ""
        vocab, width = t.shape(f"{base}embeddings.token_embedding.weight", where, "the token embedding")
        positions = t.shape(f"{base}embeddings.position_embedding.weight", where, "the position embedding")[0]
        layers = t.count(f"{base}encoder.layers")
        mlp = t.shape(f"{base}encoder.layers.0.mlp.fc1.weight", where, "the first layer's MLP")[0]
        projection, act = width, "quick_gelu"
    else:
        vocab, width = t.shape("token_embedding.weight", where, "the token embedding")
        positions = t.shape("positional_embedding", where, "the position embedding")[0]
        layers = t.count("transformer.resblocks") - (family.name == "sd2")
        mlp = t.shape("transformer.resblocks.0.mlp.c_fc.weight", where, "the first block's MLP")[0]
        projection = t.shape("text_projection", where)[1] if t.has("text_projection") else width
        act = "gelu"
    if layers < 1:
        raise _cannot_infer(where, f"the {part.name} under {part.prefix!r} has no layers")
    return {"vocab_size": vocab, "hidden_size": width, "intermediate_size": mlp, "projection_dim": projection,
            "num_hidden_layers": layers, "num_attention_heads": _heads(width), "max_position_embeddings": positions,
            "hidden_act": act, "layer_norm_eps": 1e-5, "bos_token_id": 49406, "eos_token_id": 49407,
            "pad_token_id": 1}


def openclip_padding_block(config: CLIPTextConfig, prefix: str, index: int) -> dict[str, np.ndarray]:
    """An OpenCLIP block of zeros (an identity: zero norm scales, zero projections) at ``index``: the unused last
    block an SD 2.x file holds, written so the file keeps SD 2.x's convention."""
    h, m, dt = config.hidden_size, config.intermediate_size, np.float32
    shapes = {"attn.in_proj_weight": (3 * h, h), "attn.in_proj_bias": (3 * h,), "attn.out_proj.weight": (h, h),
              "attn.out_proj.bias": (h,), "ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,),
              "ln_2.bias": (h,), "mlp.c_fc.weight": (m, h), "mlp.c_fc.bias": (m,), "mlp.c_proj.weight": (h, m),
              "mlp.c_proj.bias": (h,)}
    return {f"{prefix}transformer.resblocks.{index}.{k}": np.zeros(s, dt) for k, s in shapes.items()}


# -- checking a file against a model, and writing a model in the layout ----------------------------------------------


class _Shapes:
    """The names and shapes of a model's tensors, no values: what :func:`convert` needs to work out a layout."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self._shapes = dict(shapes)

    def names(self):
        return list(self._shapes)

    def shape(self, name):
        return self._shapes[name]

    def dtype(self, name):
        return np.dtype(np.float32)

    def get(self, name):
        raise CheckpointError(f"{name!r}: only the shapes of this model are known here")


def layout_shapes(abstract, rules) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``abstract`` (a module, abstract or not) has in the layout ``rules`` read."""
    leaves, specs, _ = leaf_specs(abstract)
    shapes = {n: spec.torch_shape(leaf.shape) for leaf, spec in zip(leaves, specs) for n in spec.names}
    view = convert(_Shapes(shapes), inverse(rules), where="model")
    return {n: tuple(view.shape(n)) for n in view.names()}


def check_tensors(view, abstract, rules, *, where: str, what: str, hint: str) -> None:
    """Raise a :class:`CheckpointError` naming, in the file's own names, every tensor ``abstract`` needs that the
    file (``view``) lacks or holds in another shape."""
    expected = layout_shapes(abstract, rules)
    held = set(view.names())
    missing = sorted(n for n in expected if n not in held)
    wrong = [f"{n!r} is {tuple(view.shape(n))}, the config gives {s}" for n, s in expected.items()
             if n in held and tuple(view.shape(n)) != s]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_short(missing)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of another shape: {_short(wrong, 4, quote=False)}")
    if problems:
        raise CheckpointError(f"{what} in {where}: {'; '.join(problems)}. {hint}")


def layout_tensors(model, rules) -> dict[str, np.ndarray]:
    """``model``'s parameters in the layout ``rules`` read (their inverse), as NumPy arrays."""
    return convert_tensors(state_dict(model), inverse(rules), where=f"{type(model).__name__} state dict")


# -- helpers ----------------------------------------------------------------------------------------------------------


class _Stored:
    """The names and shapes under ``prefix`` in a file, the prefix removed."""

    def __init__(self, view, prefix: str):
        self.prefix = prefix
        self.shapes = {n[len(prefix):]: tuple(view.shape(n)) for n in view.names() if n.startswith(prefix)}
        self.names = list(self.shapes)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str, where: str, what: str | None = None) -> tuple[int, ...]:
        if name not in self.shapes:
            about = f" ({what})" if what else ""
            raise CheckpointError(f"{where} lacks tensor {self.prefix + name!r}{about}; the file is incomplete or "
                                  "not in this layout: download it again, or pass config= and load its models one "
                                  "by one with eqxdiff.load(file, ..., conversion=...)")
        return self.shapes[name]

    def indices(self, head: str) -> list[int]:
        """The sorted ``i`` of every ``head.{i}.`` name."""
        pattern = re.compile(re.escape(head) + r"\.(\d+)\.")
        return sorted({int(m.group(1)) for n in self.names if (m := pattern.match(n))})

    def count(self, head: str) -> int:
        return len(self.indices(head))


def _cannot_infer(where: str, why: str) -> CheckpointError:
    return CheckpointError(f"cannot infer the config of {where}: {why}. Pass config= a diffusers folder or Hub id "
                           "of this model (its model_index.json and component config.json files)")


def _short(items, limit: int = 6, quote: bool = True) -> str:
    items = list(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(repr(i) if quote else str(i) for i in items[:limit]) + more


__all__ = ["FAMILIES", "KNOWN_PREFIXES", "PICKLE_SUFFIXES", "SDXL_REFINER_OPENCLIP", "UNET", "VAE", "Family",
           "Layout", "Part", "check_tensors", "clip_text", "detect", "infer_clip_config", "infer_unet_config",
           "infer_vae_config", "layout_shapes", "layout_tensors", "ldm_unet", "ldm_vae", "openclip_padding_block",
           "openclip_text_rules", "text_rules"]
