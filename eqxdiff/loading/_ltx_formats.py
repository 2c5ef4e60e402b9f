"""LTX-Video's original (Lightricks) checkpoint names as conversion rules: the transformer of
``ltx-video-2b-v0.9.x.safetensors`` / ``ltxv-13b-0.9.x-*.safetensors`` (below ``model.diffusion_model.``) and their
VAE (below ``vae.``), as diffusers' ``convert_ltx_transformer_checkpoint_to_diffusers`` and
``convert_ltx_vae_checkpoint_to_diffusers`` rename them. Re-exported by :mod:`eqxdiff.loading.formats`.

The original VAE numbers its blocks in one list per encoder and decoder, in the order they run: each of diffusers'
sub-blocks (a block's ResNet blocks, its down- or upsampler, its width-changing ResNet block) is one original block.
diffusers' converter holds that numbering as fixed tables per release (0.9.0, 0.9.1, 0.9.5+); here it is derived from
the config's block layout (:meth:`~eqxdiff.models.ltx_vae.AutoencoderKLLTXVideoConfig.encoder_blocks`), which gives
those tables for the released configs (tested against the converter) and any other layout too.
"""

from collections.abc import Mapping

import numpy as np

from ..core import ModelConfig, resolve_class
from ._convert import Drop, Rename, Rule
from ._rules import select

LTX_DIFFUSION_MODEL = "model.diffusion_model."  # Lightricks' single files: the transformer below it
LTX_VAE = "vae."  # ... and the VAE below this
LTX_STATISTICS = "per_channel_statistics."  # the VAE's latent statistics, below LTX_VAE
LTX_UNUSED_STATISTICS = ("channel", "mean-of-stds", "mean-of-stds_over_std-of-means")
"""The statistics entries Lightricks' files carry beside ``mean-of-means`` / ``std-of-means`` (diffusers'
``latents_mean`` / ``latents_std``) that no loader reads: diffusers' converter drops them (``channel`` and, by
substring, both ``mean-of-stds`` entries), Lightricks' and ComfyUI's VAEs read only the other two."""


def ltx_transformer(*, prefix: str = "") -> tuple[Rule, ...]:
    """The original LTX-Video transformer (``prefix``: where a single file keeps it, :data:`LTX_DIFFUSION_MODEL`) as
    diffusers' ``LTXVideoTransformer3DModel``: ``patchify_proj`` is ``proj_in``, ``adaln_single`` ``time_embed``,
    each attention's ``q_norm`` / ``k_norm`` ``norm_q`` / ``norm_k``; the other names are diffusers'.

    >>> eqxdiff.load("ltx-video-2b-v0.9.5.safetensors", model_class="LTXVideoTransformer3DModel",
    ...              config="Lightricks/LTX-Video-0.9.5", subfolder="transformer",
    ...              conversion=formats.ltx_transformer(prefix=formats.LTX_DIFFUSION_MODEL))
    """
    b = "transformer_blocks.{i}.{attn}."
    rules: list[Rule] = list(select(prefix)) if prefix else []
    rules += [Rename("patchify_proj.{p}", "proj_in.{p}"), Rename("adaln_single.{name}", "time_embed.{name}"),
              Rename(b + "q_norm.{p}", b + "norm_q.{p}"), Rename(b + "k_norm.{p}", b + "norm_k.{p}")]
    return tuple(rules)


def _vae_config(config):
    if isinstance(config, ModelConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"ltx_vae: config={config!r}; pass the VAE's config (an AutoencoderKLLTXVideoConfig or its "
                        "config.json as a dict)")
    return resolve_class("AutoencoderKLLTXVideo").config_class.from_dict(config)


def _resnet_block(theirs: str, ours: str) -> list[Rule]:
    """A width-changing ResNet block stored as its own original block: moved, then its shortcut conv and norm renamed
    (in this order, so that the inverse renames them back before moving the block)."""
    return [Rename(f"{theirs}.{{rest}}", f"{ours}.{{rest}}"),
            Rename(f"{ours}.conv_shortcut.{{p}}", f"{ours}.conv_shortcut.conv.{{p}}"),
            Rename(f"{ours}.norm3.norm.{{p}}", f"{ours}.norm3.{{p}}")]


def _resnets(theirs: str, ours: str, timestep: bool) -> list[Rule]:
    """An original ``res_x`` block: its ``res_blocks`` are diffusers' ``resnets`` (and its time embedder)."""
    rules: list[Rule] = [Rename(f"{theirs}.res_blocks.{{rest}}", f"{ours}.resnets.{{rest}}")]
    if timestep:
        rules.append(Rename(f"{theirs}.time_embedder.{{rest}}", f"{ours}.time_embedder.{{rest}}"))
    return rules


def _encoder(c) -> list[Rule]:
    theirs, ours, n, rules = "encoder.down_blocks", "encoder.down_blocks", 0, []
    for k, block in enumerate(c.encoder_blocks()):
        if block.layers:
            rules += _resnets(f"{theirs}.{n}", f"{ours}.{k}", False)
            n += 1
        if block.downsample:
            rules.append(Rename(f"{theirs}.{n}.{{rest}}", f"{ours}.{k}.downsamplers.0.{{rest}}"))
            n += 1
        if block.conv_out:
            rules += _resnet_block(f"{theirs}.{n}", f"{ours}.{k}.conv_out")
            n += 1
    return rules + _resnets(f"{theirs}.{n}", "encoder.mid_block", False)


def _decoder(c) -> list[Rule]:
    theirs, ours, tc = "decoder.up_blocks", "decoder.up_blocks", c.timestep_conditioning
    rules, n = _resnets(f"{theirs}.0", "decoder.mid_block", tc), 1
    for k, block in enumerate(c.decoder_blocks()):
        if block.conv_in:
            rules += _resnet_block(f"{theirs}.{n}", f"{ours}.{k}.conv_in")
            n += 1
        if block.upsample:
            rules.append(Rename(f"{theirs}.{n}.{{rest}}", f"{ours}.{k}.upsamplers.0.{{rest}}"))
            n += 1
        if block.layers:
            rules += _resnets(f"{theirs}.{n}", f"{ours}.{k}", tc)
            n += 1
    if tc:
        rules += [Rename("decoder.last_time_embedder.{rest}", "decoder.time_embedder.{rest}"),
                  Rename("decoder.last_scale_shift_table", "decoder.scale_shift_table")]
    return rules


def ltx_vae(config, *, prefix: str = "") -> tuple[Rule, ...]:
    """The original LTX-Video VAE (``prefix``: where a single file keeps it, :data:`LTX_VAE`) of a model with
    ``config`` (an ``AutoencoderKLLTXVideoConfig`` or its config.json as a dict) as diffusers'
    ``AutoencoderKLLTXVideo``: the encoder's and decoder's blocks renumbered (see the module docstring), the
    width-changing ResNet blocks' ``conv_shortcut`` / ``norm3.norm`` renamed, ``last_time_embedder`` /
    ``last_scale_shift_table`` the decoder's ``time_embedder`` / ``scale_shift_table``, and the latent statistics
    ``per_channel_statistics.mean-of-means`` / ``std-of-means`` the ``latents_mean`` / ``latents_std`` tensors (the
    :data:`LTX_UNUSED_STATISTICS` entries dropped). The inverse writes the original names back; the dropped entries
    are :func:`ltx_unused_statistics`.

    >>> config = eqxdiff.loading.read_config("Lightricks/LTX-Video-0.9.5", "vae")
    >>> eqxdiff.load("ltx-video-2b-v0.9.5.safetensors", model_class="AutoencoderKLLTXVideo", config=config,
    ...              conversion=formats.ltx_vae(config, prefix=formats.LTX_VAE))
    """
    c = _vae_config(config)
    stats = LTX_STATISTICS
    rules: list[Rule] = list(select(prefix)) if prefix else []
    rules += [Drop(tuple(stats + n for n in LTX_UNUSED_STATISTICS), optional=True),
              Rename(stats + "mean-of-means", "latents_mean"), Rename(stats + "std-of-means", "latents_std")]
    return tuple(rules + _encoder(c) + _decoder(c))


def ltx_unused_statistics(latents_std) -> dict[str, np.ndarray]:
    """The :data:`LTX_UNUSED_STATISTICS` entries (below :data:`LTX_STATISTICS`) a written file carries so that it has
    every key of Lightricks' layout, from what eqxdiff holds: ``channel`` the channel indices ``0 .. C-1`` (float, as
    the original buffers), ``mean-of-stds`` ones (the dataset's mean per-channel std is not kept by eqxdiff or
    diffusers: a neutral stand-in that no loader reads) and ``mean-of-stds_over_std-of-means`` that over
    ``latents_std`` (``std-of-means``), as its name says."""
    std = np.asarray(latents_std)
    ones = np.ones(std.shape, std.dtype)
    values = (np.arange(std.shape[0]).astype(std.dtype), ones, ones / std)
    return {LTX_STATISTICS + n: v for n, v in zip(LTX_UNUSED_STATISTICS, values)}


__all__ = ["LTX_DIFFUSION_MODEL", "LTX_STATISTICS", "LTX_UNUSED_STATISTICS", "LTX_VAE", "ltx_transformer",
           "ltx_unused_statistics", "ltx_vae"]
