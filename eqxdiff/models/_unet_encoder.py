"""What a UNet and its encoder alone (:mod:`eqxdiff.models.controlnet`, ``controlnet_union``) share: building the
encoder (``conv_in``, the time, class and SDXL ``text_time`` embeddings, the down and mid blocks), embedding the
timestep and class labels, running the encoder, and checking the conditioning inputs."""

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from ..core import checkpoint_block, constrain
from ..nn import Conv2d, Embedding, Linear, TimestepEmbedding, activation, timestep_embedding
from ._unet_blocks import DownBlock, MidBlock

if TYPE_CHECKING:
    from .unet2d import UNet2DConditionConfig

IMAGE = ("batch", "height", "width", "channels")  # logical axes of channels-last feature maps


def build_encoder(c: "UNet2DConditionConfig", *, dtype, keys) -> tuple:
    """``(conv_in, time_embedding, add_embedding, down_blocks, mid_block)`` of config ``c``, from the five ``keys``."""
    kin, kt, ka, kd, km = keys
    ch0 = c.block_out_channels[0]
    conv_in = Conv2d(c.in_channels, ch0, c.conv_in_kernel, padding=c.conv_in_kernel // 2, dtype=dtype, key=kin)
    time_embedding = TimestepEmbedding(c.timestep_input_dim, c.time_embed_dim, act_fn=c.act_fn,
                                       post_act_fn=c.timestep_post_act, cond_proj_dim=c.time_cond_proj_dim,
                                       dtype=dtype, key=kt)
    add_embedding = (TimestepEmbedding(c.projection_class_embeddings_input_dim, c.time_embed_dim, dtype=dtype, key=ka)
                     if c.addition_embed_type == "text_time" else None)
    res = c.resnet_spec
    down_blocks = [DownBlock(s, res, dtype=dtype, key=k)
                   for s, k in zip(c.down_blocks, jax.random.split(kd, c.num_blocks))]
    mid_res = dataclasses.replace(res, output_scale_factor=c.mid_block_scale_factor)
    mid_block = MidBlock(c.mid_block, mid_res, dtype=dtype, key=km) if c.mid_block else None
    return conv_in, time_embedding, add_embedding, down_blocks, mid_block


def embed_time(model, timestep, batch: int, dtype, *, text_embeds=None, time_ids=None, timestep_cond=None,
               class_emb=None):
    """``model``'s time embedding ``[batch, time_embed_dim]`` in ``dtype`` (plus ``class_emb``, added or concatenated,
    and SDXL's ``text_time`` embedding), computed in float32 (the weights are upcast)."""
    c = model.config
    t = jnp.broadcast_to(jnp.asarray(timestep).reshape(-1), (batch,))
    emb = model.time_embedding(time_features(model, t),
                               None if timestep_cond is None else timestep_cond.astype(jnp.float32))
    if class_emb is not None:
        emb = jnp.concatenate([emb, class_emb], axis=-1) if c.class_embeddings_concat else emb + class_emb
    if model.add_embedding is not None:
        time_embeds = timestep_embedding(time_ids.reshape(-1), c.addition_time_embed_dim,
                                         flip_sin_to_cos=c.flip_sin_to_cos, freq_shift=c.freq_shift)
        add = jnp.concatenate([text_embeds.astype(jnp.float32), time_embeds.reshape(batch, -1)], axis=-1)
        emb = emb + model.add_embedding(add)
    if c.time_embedding_act_fn is not None:
        emb = activation(c.time_embedding_act_fn)(emb)
    return emb.astype(dtype)


def time_features(model, t):
    """diffusers' ``time_proj`` of timesteps ``t`` (float32): sinusoids, or a UNet's Gaussian Fourier features."""
    c = model.config
    if c.time_embedding_type == "fourier":
        return model.time_proj(t)
    return timestep_embedding(t, c.block_out_channels[0], flip_sin_to_cos=c.flip_sin_to_cos, freq_shift=c.freq_shift)


def build_class_embedding(c: "UNet2DConditionConfig", dtype, key, act_fn: str | None = None):
    """diffusers' ``class_embedding`` of config ``c`` (``None``: none, or ``"identity"``); ``act_fn`` that of a
    ``"timestep"`` one (default ``c.act_fn``)."""
    if c.class_embed_type == "timestep":
        return TimestepEmbedding(c.timestep_input_dim, c.time_embed_dim, act_fn=act_fn or c.act_fn, dtype=dtype,
                                 key=key)
    if c.class_embed_type == "projection":
        return TimestepEmbedding(c.projection_class_embeddings_input_dim, c.time_embed_dim, dtype=dtype, key=key)
    if c.class_embed_type == "simple_projection":
        return Linear(c.projection_class_embeddings_input_dim, c.time_embed_dim, dtype=dtype, key=key)
    if c.class_embed_type is None and c.num_class_embeds is not None:
        return Embedding(c.num_class_embeds, c.time_embed_dim, axes=(None, "embed"), dtype=dtype, key=key)
    return None


def embed_class(model, labels, batch: int):
    """The class embedding of ``labels`` in float32 (``None`` for a model without one), as diffusers'
    ``get_class_embed``."""
    c, name = model.config, type(model).__name__
    if not c.has_class_embedding:
        if labels is not None:
            raise ValueError(f"{name}: class_labels given, but this model has no class embedding "
                             f"(class_embed_type={c.class_embed_type!r}, num_class_embeds={c.num_class_embeds})")
        return None
    if labels is None:
        raise ValueError(f"{name}: class_embed_type={c.class_embed_type!r}, num_class_embeds={c.num_class_embeds}"
                         " needs class_labels")
    if c.class_embed_type == "timestep":
        t = jnp.broadcast_to(jnp.asarray(labels).reshape(-1), (batch,))
        labels = time_features(model, t)
    elif c.class_embed_type is None:  # a table of num_class_embeds rows
        return model.class_embedding(jnp.asarray(labels).reshape(-1).astype(jnp.int32)).astype(jnp.float32)
    labels = labels.astype(jnp.float32)
    return labels if model.class_embedding is None else model.class_embedding(labels)


def run_encoder(model, h, emb, context, mask, cross_attention_kwargs=None):
    """``conv_in``'s output through ``model``'s down blocks and mid block, with sharding constraints and the remat
    policy at each block boundary: ``(mid-block output, skips)``, the skips in the order the down path makes them.
    ``cross_attention_kwargs`` go to every cross-attention."""
    plan = model.plan
    skips = [h]
    for block in model.down_blocks:
        h, block_skips = checkpoint_block(block, plan)(h, emb, context, mask, cross_attention_kwargs)
        h = constrain(h, plan, IMAGE)
        skips.extend(block_skips)
    if model.mid_block is not None:
        h = constrain(checkpoint_block(model.mid_block, plan)(h, emb, context, mask,
                                                                 cross_attention_kwargs), plan, IMAGE)
    return h, skips


def check_conditioning(model, sample, context, text_embeds, time_ids) -> None:
    """Raise ``ValueError`` naming the fix if ``model``'s inputs do not fit its config."""
    c = model.config
    name = type(model).__name__
    if sample.shape[-1] != c.in_channels:
        hint = (" It looks channels-first; eqxdiff is channels-last: use jnp.moveaxis(sample, 1, -1)."
                if sample.shape[1] == c.in_channels else "")
        raise ValueError(f"{name}: sample must be [batch, height, width, {c.in_channels}] (channels-last), got "
                         f"shape {sample.shape}.{hint}")
    if c.context_dim is not None and context.shape[-1] != c.context_dim:
        raise ValueError(f"{name}: encoder_hidden_states must be [batch, seq, {c.context_dim}] "
                         f"(cross_attention_dim), got shape {context.shape}")
    if c.addition_embed_type == "text_time":
        if text_embeds is None or time_ids is None:
            raise ValueError(f"{name}: addition_embed_type='text_time' (SDXL) needs text_embeds (the pooled text "
                             "embedding) and time_ids (original size, crop, target size); got text_embeds="
                             f"{getattr(text_embeds, 'shape', None)}, time_ids={getattr(time_ids, 'shape', None)}")
        got = text_embeds.shape[-1] + time_ids.shape[-1] * c.addition_time_embed_dim
        if got != c.projection_class_embeddings_input_dim:
            raise ValueError(f"{name}: text_embeds {text_embeds.shape} and time_ids {time_ids.shape} give "
                             f"{text_embeds.shape[-1]} + {time_ids.shape[-1]} * {c.addition_time_embed_dim} = "
                             f"{got} features, but projection_class_embeddings_input_dim="
                             f"{c.projection_class_embeddings_input_dim}")
    elif text_embeds is not None or time_ids is not None:
        raise ValueError(f"{name}: text_embeds/time_ids are only used with addition_embed_type='text_time'; "
                         f"this model has addition_embed_type={c.addition_embed_type!r}")
