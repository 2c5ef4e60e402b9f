"""IP-Adapter on the UNet pipelines (Stable Diffusion 1.x/2.x, SDXL), with diffusers' method and argument names:
``load_ip_adapter``, ``set_ip_adapter_scale``, ``unload_ip_adapter`` and the calls' ``ip_adapter_image`` /
``ip_adapter_image_embeds``.

The adapters' weights go into the UNet's cross-attentions (:mod:`eqxdiff.models.ip_adapter`); their image
projections stay here. A call encodes the image prompt with the CLIP image encoder (the ``image_embeds`` of
``CLIPVisionModelWithProjection``, after ``CLIPImageProcessor``'s resize, crop and normalisation, as diffusers'
``encode_image``), projects it into tokens and appends them to the text embeddings (``[negative; positive]`` rows
with guidance, the negative image embedding zeros as diffusers'); the denoising loop runs as without adapters. An
adapter given several images (a list) reads their tokens one image after the other, as diffusers' attention reads
its ``[batch, images, tokens, dim]``; the counts are shapes in the UNet (a new count compiles). The scales are values
in the UNet: ``set_ip_adapter_scale`` compiles nothing. One scale config (a number, a per-block dict, or a list
holding one) with several adapters loaded applies to each of them; diffusers' ``set_ip_adapter_scale`` refuses it
("Cannot assign 1 scale_configs to 2 IP-Adapter": its length check comes before its broadcast), so there give the list
with one config per adapter, which both take alike. The image processor is ``CLIPImageProcessor`` at the image
encoder's size; diffusers uses the pipeline's ``feature_extractor`` instead where its folder has one (SD 1.x's, for
the safety checker: the same settings at 224 px, the size of the usual IP-Adapter encoders). Per-image scales (for
masked images) are one list per adapter for every layer (``[[0.5, 0.6]]``) or, as diffusers takes them, inside a
per-block dict for the layers given (``{"down": [[0.5, 0.6]]}``: the down blocks weight the masked images 0.5 and
0.6, the other layers 0); values in the UNet per layer and image.
"""

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from .._typing import Array, Float
from ..core import program
from ..loading import CheckpointError, load, safetensors_path
from ..loading import read_safetensors_file as _read
from ..models import ip_adapter as ipa
from ..parallel import shard_params, sharding_fn
from ._arguments import host_array
from ._checks import InputError, InputTypeError
from ._ip_adapter_masks import AdapterMasks, as_adapter_masks, mask_weights, resolutions

__all__ = ["IPAdapterMixin", "IPAdapters", "clip_hidden_states", "clip_image_embeds"]

_LOAD_FIRST = "load one first: pipe.load_ip_adapter(folder_or_hub_id, subfolder=..., weight_name='....safetensors')"


@dataclasses.dataclass(frozen=True)
class IPAdapters:
    """What :meth:`IPAdapterMixin.load_ip_adapter` loaded besides the UNet's layers: each adapter's image projection,
    the CLIP image encoder and its image processor (``None`` without one: pass ``ip_adapter_image_embeds``)."""

    projections: tuple
    image_encoder: Any = None
    feature_extractor: Any = None
    # per adapter: None, or one scale per image (set_ip_adapter_scale([[s_1, ..., s_n]])), for masked images only
    image_scales: tuple = ()


@program
def clip_image_embeds(image_encoder, pixel_values: Float[Array, "n size size 3"]) -> Float[Array, "n embed"]:
    """The projected CLIP image embedding (``CLIPVisionModelWithProjection``'s ``image_embeds``)."""
    return image_encoder(pixel_values).image_embeds


@program
def clip_hidden_states(image_encoder, pixel_values: Float[Array, "n size size 3"]) -> Float[Array, "n tokens dim"]:
    """The CLIP image encoder's penultimate hidden states (``hidden_states[-2]``), IP-Adapter Plus's input."""
    return image_encoder(pixel_values, output_hidden_states=True).hidden_states[-2]


@program
def _project(projections, embeds):
    """Each adapter's tokens ``[rows, images * tokens, width]`` of its embeddings ``[rows, images, ...]``, concatenated:
    each image projected alone, its tokens after the previous image's (diffusers' ``MultiIPAdapterImageProjection``
    and the ``[rows, images, tokens, width]`` its attention processor reads through ``to_k_ip``)."""
    out = []
    for projection, e in zip(projections, embeds):
        rows, images = e.shape[:2]
        tokens = projection(e.reshape(rows * images, *e.shape[2:]))
        out.append(tokens.reshape(rows, images * tokens.shape[1], tokens.shape[2]))
    return jnp.concatenate(out, axis=1)


def _state(source, subfolder, weight_name, revision) -> dict:
    """``{"image_proj": {...}, "ip_adapter": {...}}`` of numpy arrays from a dict (that layout, or the flat
    ``image_proj.*`` / ``ip_adapter.*`` one of the files) or a safetensors file."""
    if isinstance(source, Mapping):
        flat = source
    else:
        where = Path(os.fspath(source)).expanduser()
        if where.is_dir() and subfolder:
            where, name = where / subfolder, weight_name
        else:
            where, name = source, (f"{subfolder}/{weight_name}" if subfolder and weight_name else weight_name)
        flat = _read(safetensors_path(where, weight_name=name, revision=revision, default_name="ip-adapter.safetensors",
                                      what="IP-Adapter"))
    state = {"image_proj": {}, "ip_adapter": {}}
    for key, value in flat.items():
        if key in state and isinstance(value, Mapping):
            state[key].update(value)
            continue
        part, _, rest = str(key).partition(".")
        if part not in state or not rest:
            raise CheckpointError(f"IP-Adapter: {key!r} is neither image_proj.* nor ip_adapter.*: not an IP-Adapter "
                                  "state dict (diffusers' layout: {'image_proj': {...}, 'ip_adapter': {...}})")
        state[part][rest] = value
    if not state["image_proj"] or not state["ip_adapter"]:
        raise CheckpointError("IP-Adapter: the state dict needs both image_proj and ip_adapter tensors")
    return {part: {k: host_array(v)
                   for k, v in tensors.items()} for part, tensors in state.items()}


def _as_list(value, n: int, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) == 1:
        values = values * n
    if len(values) != n:
        raise InputError(f"{name} has {len(values)} entries for {n} IP-Adapter file(s)")
    return values


class IPAdapterMixin:
    """diffusers' IP-Adapter methods on the UNet pipelines (see the module docstring)."""

    ip_adapter: IPAdapters | None = None  # what load_ip_adapter loaded; carried by from_pipe with the UNet

    def load_ip_adapter(self, pretrained_model_name_or_path_or_dict, subfolder=None, weight_name=None, *,
                        image_encoder_folder: str | None = "image_encoder", revision: str | None = None) -> None:
        """Load IP-Adapter(s) as diffusers' ``load_ip_adapter``: a folder or Hub id with ``subfolder`` and
        ``weight_name`` (a ``.safetensors`` file: pickles such as ``.bin`` are refused, never unpickled), or a state
        dict in memory (``{"image_proj": {...}, "ip_adapter": {...}}`` or the file's flat names); lists load several.
        The CLIP image encoder comes from ``image_encoder_folder`` (a name inside ``subfolder``, or a path with
        ``/`` inside the repository) unless the pipeline has one; ``None``: none (pass ``ip_adapter_image_embeds``).
        Loading replaces adapters loaded before; every scale starts at 1."""
        sources = list(pretrained_model_name_or_path_or_dict) if isinstance(
            pretrained_model_name_or_path_or_dict, (list, tuple)) else [pretrained_model_name_or_path_or_dict]
        subfolders = _as_list(subfolder, len(sources), "subfolder")
        names = _as_list(weight_name, len(sources), "weight_name")
        states = [_state(s, f, n, revision) for s, f, n in zip(sources, subfolders, names)]
        unet, projections = self._with_ip_layers(self.unet, states)
        encoder = None if self.ip_adapter is None else self.ip_adapter.image_encoder
        if encoder is None and image_encoder_folder is not None and not isinstance(sources[0], Mapping):
            folder = image_encoder_folder if "/" in image_encoder_folder else (
                Path(subfolders[0], image_encoder_folder).as_posix() if subfolders[0] else image_encoder_folder)
            onto_mesh = self.mesh is not None and not self.offload_encoders
            encoder = self.place(load(sources[0], subfolder=folder, dtype=unet.conv_in.weight.dtype, revision=revision,
                                      sharding=sharding_fn(self.mesh, self.rules) if onto_mesh else None), encoder=True)
            plain = any(not p.READS_HIDDEN_STATES for p in projections)
            if plain and getattr(encoder, "visual_projection", None) is None:
                raise CheckpointError(f"the image encoder in {folder!r} is a {type(encoder).__name__}; the plain "
                                      "IP-Adapter reads CLIPVisionModelWithProjection's image_embeds")
        if self.mesh is not None:
            projections = shard_params(projections, self.mesh, self.rules)
        self.unet = unet
        self.rewrite_lora_copies("unet", lambda kept: self._with_ip_layers(kept, states)[0])  # LoRA's kept UNets
        self.ip_adapter = IPAdapters(tuple(projections), encoder, None if encoder is None else _processor(encoder))

    def unload_ip_adapter(self) -> None:
        """Take the IP-Adapters out: the UNet's cross-attentions as before, the image encoder dropped."""
        self.unet = ipa.remove_ip_adapters(self.unet)
        self.rewrite_lora_copies("unet", ipa.remove_ip_adapters)
        self.ip_adapter = None

    def _with_ip_layers(self, unet, states):
        """``(unet, projections)``: ``unet`` with the adapters of ``states`` in place of any it held, placed as the
        pipeline's weights."""
        unet, projections = ipa.load_ip_adapters(ipa.remove_ip_adapters(unet), states)
        return (unet if self.mesh is None else shard_params(unet, self.mesh, self.rules)), projections

    def models_to_save(self) -> dict[str, Any]:
        """The models as :func:`~eqxdiff.pipelines.save_pipeline` writes them: the UNet without its IP-Adapters (a
        diffusers folder has no place for them; load them again after loading the folder)."""
        out = super().models_to_save()
        if "unet" in out:
            out["unet"] = ipa.remove_ip_adapters(out["unet"])
        return out

    def set_ip_adapter_scale(self, scale) -> None:
        """The adapters' strengths, as diffusers': one config for every adapter (which diffusers refuses with several
        adapters: see the module docstring) or a list with one per adapter, each a number (every layer) or
        InstantStyle's per-block dict (``{"down": {"block_2": [0.0, 1.0]}, "up": {"block_0": [0.0, 1.0, 0.0]}}``: a
        number per part or block, or a list with one per spatial transformer of the block; what it leaves out is 0).
        An adapter's list of numbers (``[[0.7, 0.4]]``) is one scale per image, which diffusers applies to masked
        images only (:mod:`~eqxdiff.pipelines._ip_adapter_masks`): a call then needs that adapter's
        ``ip_adapter_masks``. Inside a per-block dict such a list holds for the layers it is given to
        (``{"down": {"block_2": [[0.5, 0.6]]}}``: block 2's transformers; ``{"down": [[0.5, 0.6]]}``: every down
        block's; ``{"mid": [[0.5, 0.6]]}``); the other layers take their numbers for every masked image. Values only:
        nothing compiles, except the first time an adapter gets more per-image scales than before (a shape)."""
        if self.ip_adapter is None:
            raise InputError(f"set_ip_adapter_scale: no IP-Adapter is loaded; {_LOAD_FIRST}")
        configs = _as_list(scale, len(self.ip_adapter.projections), "set_ip_adapter_scale's list")
        blocks = ipa.cross_attention_blocks(self.unet)
        per_layer = [_expand_scale(c, blocks) for c in configs]  # per adapter: a number or a tuple per layer
        per_image = tuple(_image_scales(values, a) for a, values in enumerate(per_layer))
        width = max([1, ipa.ip_adapter_scales(self.unet, image_scales=True).shape[2],
                     *(len(v) for values in per_layer for v in values if isinstance(v, tuple))])
        rows = np.stack([[float(any(v)) if isinstance(v, tuple) else v for v in values] for values in per_layer],
                        axis=1)  # [cross-attentions, adapters]: a per-image layer's scale is 1 (0 if all its are 0)
        images = np.stack([[np.pad(np.float32(v), (0, width - len(v)), constant_values=1.0) if isinstance(v, tuple)
                            else np.ones(width, np.float32) for v in values] for values in per_layer], axis=1)
        self.unet = ipa.with_ip_adapter_scales(self.unet, rows, images)
        self.rewrite_lora_copies("unet", lambda kept: ipa.with_ip_adapter_scales(kept, rows, images))
        self.ip_adapter = dataclasses.replace(self.ip_adapter, image_scales=per_image)

    def encode_image(self, image, output_hidden_states: bool = False) -> tuple[Array, Array]:
        """``(embeds, negative_embeds)`` of ``image`` (a PIL image, uint8 ``[h, w, 3]`` / ``[n, h, w, 3]``, or a
        list), as diffusers' ``encode_image``: the image embeddings ``[n, embed]`` and zeros, or with
        ``output_hidden_states`` (IP-Adapter Plus) the penultimate hidden states ``[n, tokens, dim]`` of the image
        and of an all-zero input. PIL images go to the image processor as they are (it composites RGBA, palette and
        the like over white, as diffusers'); a torch tensor is the processor's output already (``pixel_values``
        ``[n, 3, size, size]``), as diffusers takes one."""
        adapters = self.ip_adapter
        if adapters is None or adapters.image_encoder is None:
            raise InputError("ip_adapter_image needs a CLIP image encoder; load the IP-Adapter with "
                             "image_encoder_folder=, or pass ip_adapter_image_embeds")
        if hasattr(image, "detach"):  # diffusers: a tensor skips the feature extractor
            pixels = host_array(image, np.float32)
            size = adapters.image_encoder.config.image_size
            if pixels.shape[1:] != (3, size, size):
                raise InputError(f"ip_adapter_image: a torch tensor is taken as the image processor's pixel_values "
                                 f"[n, 3, {size}, {size}], as diffusers takes it; got {tuple(pixels.shape)} (give "
                                 "PIL images or uint8 arrays [h, w, 3] to have them resized and normalised)")
        else:
            images = []
            for item in image if isinstance(image, (list, tuple)) else [image]:
                arr = item if isinstance(item, Image.Image) else np.asarray(item)
                images.extend(arr if np.ndim(arr) == 4 else [arr])
            pixels = adapters.feature_extractor(images=images, return_tensors="np").pixel_values
        pixels = self.shard(jnp.asarray(np.transpose(pixels, (0, 2, 3, 1)), jnp.float32))  # channels-last
        encoder = self.encoder_on_devices(adapters.image_encoder)
        if output_hidden_states:
            return (clip_hidden_states(encoder, pixels).astype(jnp.float32),
                    clip_hidden_states(encoder, jnp.zeros_like(pixels)).astype(jnp.float32))
        embeds = clip_image_embeds(encoder, pixels).astype(jnp.float32)
        return embeds, jnp.zeros_like(embeds)

    def with_ip_adapter_tokens(self, embeds: Array, ip_adapter_image, ip_adapter_image_embeds, guided: bool, *,
                               num_images_per_prompt: int) -> tuple[Array, "IPAdapterMixin"]:
        """``(embeds, pipe)``: ``embeds`` (the text embeddings, ``[negative; positive]`` rows with guidance) with the
        IP-Adapters' image tokens appended to each row (diffusers' ``prepare_ip_adapter_image_embeds`` and the
        UNet's projection), and the pipeline to generate them with. An adapter may take several images (diffusers'
        list of images per adapter, or embeddings ``[.., images, ...]``): their tokens follow each other, and
        ``pipe``'s UNet reads that many (:meth:`reading_images`). Without adapters: ``embeds`` and ``self``."""
        if self.ip_adapter is None:
            return embeds, self
        n = len(self.ip_adapter.projections)
        rows = embeds.shape[0] // (2 if guided else 1)
        per_adapter = (self._embeds_of_images(ip_adapter_image, n) if ip_adapter_image is not None else
                       self._given_embeds(ip_adapter_image_embeds, n, guided))
        positive, negative = [], []
        for a, (pos, neg) in enumerate(per_adapter):
            pos, neg = (_rows(x, rows, num_images_per_prompt, a) for x in (pos, neg))
            positive.append(pos)
            negative.append(neg)
        pipe = self.reading_images([pos.shape[1] for pos in positive])
        tokens = _project(self.ip_adapter.projections, positive)
        if guided:
            tokens = jnp.concatenate([_project(self.ip_adapter.projections, negative), tokens])
        return jnp.concatenate([embeds, tokens.astype(embeds.dtype)], axis=1), pipe

    def reading_images(self, counts: Sequence[int]) -> "IPAdapterMixin":
        """This pipeline for one call whose adapters take ``counts[a]`` images each: itself if its UNet reads that
        many, else a shallow copy (sharing every component and :attr:`~eqxdiff.pipelines.DiffusionPipeline.timings`)
        whose UNet does (:func:`~eqxdiff.models.ip_adapter.with_image_counts`: static, so a new count compiles and
        the same count does not). The pipeline itself is left as it is: a call's counts never reach another call."""
        unet = ipa.with_image_counts(self.unet, counts)
        if unet is self.unet:
            return self
        pipe = copy.copy(self)
        pipe.unet = unet
        return pipe

    def ip_adapter_conditioning(self, ip_adapter_masks, rows: int, height: int, width: int) -> dict:
        """The UNet's ``cross_attention_kwargs`` for this call's ``ip_adapter_masks`` (``rows``: the UNet's batch,
        ``height`` x ``width``: the latents), as conditioning arrays: ``{}`` without masks, else the masks resized
        to every resolution of the UNet, the per-image scales checked (:func:`~eqxdiff.pipelines._ip_adapter_masks.
        mask_weights`; values: a new mask compiles nothing)."""
        if self.ip_adapter is None:
            return {}
        factor = self.vae_scale_factor
        masks, scales = self._masks_and_scales(ip_adapter_masks, (height * factor, width * factor))
        if all(m is None for m in masks):
            return {}
        weights = mask_weights(masks, ipa.image_counts(self.unet), scales, rows, resolutions(self.unet, height, width))
        return {"cross_attention_kwargs": {"ip_adapter_masks": jax.tree.map(jnp.asarray, weights)}}

    def _masks_and_scales(self, ip_adapter_masks, size: tuple[int, int] | None = None) -> tuple[list, tuple]:
        """``(masks, scales)`` per adapter (:func:`~eqxdiff.pipelines._ip_adapter_masks.as_adapter_masks` at the
        output's ``size``, the per-image scales); an adapter with per-image scales needs a mask, as in diffusers.
        Masks the call's check resolved (:class:`~eqxdiff.pipelines._ip_adapter_masks.AdapterMasks`) were checked
        there: only their mask images are made into masks at ``size``."""
        n = len(self.ip_adapter.projections)
        scales = self.ip_adapter.image_scales or (None,) * n
        if isinstance(ip_adapter_masks, AdapterMasks):
            return as_adapter_masks(ip_adapter_masks, n, size), scales
        masks = [None] * n if ip_adapter_masks is None else as_adapter_masks(ip_adapter_masks, n, size)
        for a, (mask, scale) in enumerate(zip(masks, scales)):
            if mask is None and scale is not None:
                raise InputError(f"IP-Adapter {a} has one scale per image ({list(scale)}), which diffusers applies to "
                                 "masked images only: pass its ip_adapter_masks, or give it one scale "
                                 "(pipe.set_ip_adapter_scale)")
        return masks, scales

    def check_ip_adapter_arguments(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A call's ``ip_adapter_image`` / ``ip_adapter_image_embeds`` / ``ip_adapter_masks`` fit the loaded adapters
        (checked before anything is encoded). Returns ``{"ip_adapter_masks": ...}`` resolved
        (:class:`~eqxdiff.pipelines._ip_adapter_masks.AdapterMasks`) when the call gives masks, for the call to take
        in their place (:meth:`~eqxdiff.pipelines.DiffusionPipeline.check_call`), else ``{}``."""
        image, embeds = arguments.get("ip_adapter_image"), arguments.get("ip_adapter_image_embeds")
        given, masks = image is not None or embeds is not None, arguments.get("ip_adapter_masks")
        if self.ip_adapter is None:
            if given or masks is not None:
                what = "ip_adapter_image / ip_adapter_image_embeds" if given else "ip_adapter_masks"
                raise InputError(f"{what}: no IP-Adapter is loaded; {_LOAD_FIRST}")
            return {}
        checked, _ = self._masks_and_scales(masks)
        resolved = {} if masks is None else {"ip_adapter_masks": checked}
        if not given:
            raise InputError("this pipeline has an IP-Adapter loaded: pass ip_adapter_image= or "
                             "ip_adapter_image_embeds=, or call pipe.unload_ip_adapter()")
        if image is not None and embeds is not None:
            raise InputError("pass ip_adapter_image or ip_adapter_image_embeds, not both")
        if image is not None and self.ip_adapter.image_encoder is None:
            raise InputError("ip_adapter_image needs a CLIP image encoder, and the IP-Adapter was loaded without one: "
                             "load it with image_encoder_folder=, or pass ip_adapter_image_embeds")
        if embeds is not None:
            self._given_embeds(embeds, len(self.ip_adapter.projections), guided=False)
        if image is not None:
            _per_adapter(image, len(self.ip_adapter.projections))
        return resolved

    def _embeds_of_images(self, images, n: int) -> list:
        out = []
        for image, projection in zip(_per_adapter(images, n), self.ip_adapter.projections):
            pos, neg = self.encode_image(image, output_hidden_states=projection.READS_HIDDEN_STATES)
            out.append((pos[None], neg[None]))  # [1, images, embed]
        return out

    def _given_embeds(self, given, n: int, guided: bool) -> list:
        given = list(given) if isinstance(given, (list, tuple)) else [given]
        if len(given) != n:
            raise InputError(f"ip_adapter_image_embeds holds {len(given)} arrays for {n} IP-Adapters: give one per "
                             "adapter, each [2 (negative; positive) or 1, images, embed] ([..., tokens, dim] for "
                             "IP-Adapter Plus)")
        out = []
        for a, e in enumerate(given):
            e = jnp.asarray(host_array(e, np.float32))
            projection = self.ip_adapter.projections[a]
            want, plus = projection.embed_dim, projection.READS_HIDDEN_STATES
            if e.ndim != 3 + plus or e.shape[-1] != want or (guided and e.shape[0] % 2):
                raise InputError(f"ip_adapter_image_embeds[{a}] has shape {tuple(e.shape)}; it takes "
                                 f"[{'2 * n (negative; positive)' if guided else 'n'}, images, "
                                 f"{'tokens, ' if plus else ''}{want}] (diffusers' prepare_ip_adapter_image_embeds "
                                 "output)")
            if guided:
                neg, pos = jnp.split(e, 2)
            else:
                pos = e
                neg = jnp.zeros_like(e)
            out.append((pos, neg))
        return out


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, np.number)):
        raise InputTypeError(f"set_ip_adapter_scale: {where}={value!r}; give a number, a list with one per spatial "
                             "transformer of the block, or a dict of parts ('down', 'mid', 'up') and blocks "
                             "('block_0' ...)")
    return float(value)


def _expand_scale(config, blocks: Sequence[tuple[str, int, int]]) -> list:
    """One adapter's scale per cross-attention from a number, a list of per-image scales or diffusers' per-block dict
    (unset parts 0): a number, or a tuple of per-image scales, per cross-attention."""
    if isinstance(config, (list, tuple)):
        return [tuple(_number(s, "per-image scale") for s in config)] * len(blocks)
    if not isinstance(config, Mapping):
        return [_number(config, "scale")] * len(blocks)
    unknown = sorted(map(str, set(config) - {"down", "mid", "up"}))
    if unknown:
        raise InputError(f"set_ip_adapter_scale: {unknown} are not parts of the UNet; use 'down', 'mid' and 'up'")
    counts = {}
    for part, b, a in blocks:
        counts[(part, b)] = max(counts.get((part, b), 0), a + 1)
    for part in ("down", "up"):
        for name in config.get(part, {}) if isinstance(config.get(part), Mapping) else ():
            if not (name.startswith("block_") and (part, int(name[6:] or -1)) in counts):
                have = sorted(f"block_{b}" for p, b in counts if p == part)
                raise InputError(f"set_ip_adapter_scale: {part}.{name} has no attention layers; {part} has {have}")
    out = []
    for part, b, a in blocks:
        value = config.get(part, 0.0)
        if isinstance(value, Mapping):
            value = value.get(f"block_{b}", 0.0)
        if isinstance(value, (list, tuple)):
            n = counts[(part, b)]
            if len(value) not in (1, n):
                raise InputError(f"set_ip_adapter_scale: {part}.block_{b} takes 1 or {n} scales (one per spatial "
                                 f"transformer), not {len(value)}")
            value = value[0] if len(value) == 1 else value[a]
        if isinstance(value, (list, tuple)):  # one scale per masked image
            out.append(tuple(_number(s, f"{part}.block_{b}'s per-image scale") for s in value))
        else:
            out.append(_number(value, f"{part}.block_{b}"))
    return out


def _image_scales(values: Sequence, adapter: int) -> tuple[float, ...] | None:
    """An adapter's per-image scales as its masks check them (``None``: none that weigh, so no mask needed, as
    diffusers skips a layer whose scales are all 0); every layer's list must have one scale per masked image."""
    lists = [v for v in values if isinstance(v, tuple)]
    if len({len(v) for v in lists}) > 1:
        raise InputError(f"set_ip_adapter_scale: IP-Adapter {adapter}'s per-image scales have "
                         f"{sorted({len(v) for v in lists})} entries in different layers: give each layer one scale "
                         "per masked image of the adapter")
    return next((v for v in lists if any(v)), None)


def _per_adapter(images, n: int) -> list:
    """``ip_adapter_image`` as one entry per adapter (diffusers' list; one adapter also takes its entry alone), each
    an image or a list of images."""
    entries = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(entries) != n:
        raise InputError(f"ip_adapter_image holds {len(entries)} entries for {n} IP-Adapter(s): give one per adapter, "
                         "each an image or a list of images (two images on one adapter: [[image_a, image_b]])")
    return entries


def _rows(x: Array, rows: int, num_images_per_prompt: int, adapter: int) -> Array:
    """``x`` ``[m, images, ...]`` as ``[rows, images, ...]``: each of its ``m`` rows repeated
    ``num_images_per_prompt`` times (one row: every row)."""
    if x.shape[0] == 1:
        return jnp.broadcast_to(x, (rows, *x.shape[1:]))
    x = jnp.repeat(x, num_images_per_prompt, axis=0)
    if x.shape[0] != rows:
        raise InputError(f"IP-Adapter {adapter}'s embeddings have {x.shape[0] // num_images_per_prompt} rows for "
                         f"{rows // num_images_per_prompt} prompts: give one row, or one per prompt")
    return x


def _processor(encoder):
    """diffusers' default image processor for ``encoder``: ``CLIPImageProcessor`` at its image size."""
    from transformers import CLIPImageProcessor

    size = encoder.config.image_size
    return CLIPImageProcessor(size=size, crop_size=size)
