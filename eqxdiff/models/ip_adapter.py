"""IP-Adapter for the conditional UNet (Stable Diffusion 1.x/2.x, SDXL), as diffusers runs it.

An IP-Adapter adds image prompts to a UNet: an image projection turns a CLIP image embedding into a few tokens in
the UNet's cross-attention width (:class:`ImageProjection`, diffusers' name, ``image_embeds`` and ``norm``), and
every cross-attention (``attn2``) gets its own keys and values of those tokens (``to_k_ip.{i}``, ``to_v_ip.{i}`` for
adapter ``i``), attended by the same queries and added, times the adapter's scale, to the text attention before
``to_out`` (diffusers' ``IPAdapterAttnProcessor2_0``). Here the ``attn2`` layers become :class:`IPAdapterAttention`
(:func:`add_ip_adapters`), which find the image tokens at the end of the context: the caller concatenates the
projected tokens after the text embeddings, so the UNet itself and its callers are unchanged. The scales are arrays
(traced: a new scale compiles nothing; :func:`with_ip_adapter_scales`).

The adapters' files number the cross-attentions as the original IP-Adapter code does: ``1, 3, 5, ...`` in the order
diffusers lists its attention processors (down blocks, up blocks, then the mid block); :func:`cross_attention_paths`
gives that order.
"""

from collections.abc import Mapping, Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import nn
from .._typing import Array, Bool, Float, typechecked
from ..core import map_modules, replace_static
from ..nn import AbstractAttention, CrossAttention, LayerNorm, Linear, attend
from ._ip_resampler import IPAdapterPlusImageProjection, plus_image_projection

__all__ = ["IPAdapterAttention", "IPAdapterPlusImageProjection", "ImageProjection", "add_ip_adapters",
           "cross_attention_blocks", "cross_attention_paths", "has_ip_adapters", "image_projection",
           "image_counts", "image_token_count", "ip_adapter_scales", "load_ip_adapters", "remove_ip_adapters",
           "with_image_counts", "with_ip_adapter_scales"]


def _linear(weight: np.ndarray, bias: np.ndarray | None, dtype, axes=("out", "embed")) -> Linear:
    """A :class:`~eqxdiff.nn.Linear` holding ``weight`` ``[out, in]`` (and ``bias``)."""
    out_features, in_features = weight.shape
    shape = eqx.filter_eval_shape(lambda: Linear(in_features, out_features, use_bias=bias is not None, axes=axes,
                                                 dtype=dtype, key=jax.random.key(0)))
    layer = eqx.tree_at(lambda lin: lin.weight, shape, jnp.asarray(weight, dtype))
    return layer if bias is None else eqx.tree_at(lambda lin: lin.bias, layer, jnp.asarray(bias, dtype))


class ImageProjection(eqx.Module):
    """diffusers' ``ImageProjection`` (the plain IP-Adapter's ``image_proj``): a CLIP image embedding through
    ``image_embeds`` (a linear layer to ``num_tokens * cross_attention_dim``), split into ``num_tokens`` tokens,
    each layer-normed (``norm``)."""

    READS_HIDDEN_STATES: ClassVar[bool] = False  # reads the encoder's image_embeds, not its hidden states

    image_embeds: Linear
    norm: LayerNorm
    num_tokens: int = eqx.field(static=True)

    def __init__(self, image_embed_dim: int, cross_attention_dim: int, num_tokens: int = 4, *, dtype=jnp.float32,
                 key):
        self.image_embeds = Linear(image_embed_dim, num_tokens * cross_attention_dim, dtype=dtype, key=key)
        self.norm = LayerNorm(cross_attention_dim, dtype=dtype)
        self.num_tokens = num_tokens

    @property
    def embed_dim(self) -> int:
        """The width of the image embedding it reads."""
        return self.image_embeds.in_features

    @property
    def out_dim(self) -> int:
        """The width of its tokens (the UNet's ``cross_attention_dim``)."""
        return self.norm.weight.shape[0]

    @typechecked
    def __call__(self, image_embeds: Float[Array, "batch embed"]) -> Float[Array, "batch tokens dim"]:
        x = self.image_embeds(image_embeds.astype(self.image_embeds.weight.dtype))
        return self.norm(x.reshape(x.shape[0], self.num_tokens, -1))


def image_projection(state: Mapping[str, np.ndarray], *, dtype=jnp.float32):
    """The image projection of an IP-Adapter file's ``image_proj`` tensors, as diffusers tells them apart: the plain
    IP-Adapter's (``proj.weight``, ``proj.bias``, ``norm.*``: :class:`ImageProjection`) or IP-Adapter Plus's
    (``latents``, ...: :class:`IPAdapterPlusImageProjection`); ``ValueError`` naming what is there for another kind."""
    if "proj.weight" not in state:
        if "latents" in state and not any(k.startswith("perceiver_resampler.") for k in state):
            return plus_image_projection(state, dtype=dtype)
        raise ValueError(f"the IP-Adapter's image_proj holds {sorted(state)[:6]}: eqxdiff reads the plain IP-Adapter "
                         "(image_proj.proj.weight, image_proj.norm.*) and IP-Adapter Plus (image_proj.latents, ...); "
                         "Full-face and FaceID variants are not supported yet")
    weight = np.asarray(state["proj.weight"])
    width = weight.shape[0] // 4  # diffusers' num_image_text_embeds for the plain IP-Adapter
    proj = eqx.filter_eval_shape(lambda: ImageProjection(weight.shape[1], width, 4, dtype=dtype, key=jax.random.key(0)))
    return eqx.tree_at(lambda p: (p.image_embeds, p.norm.weight, p.norm.bias), proj,
                       (_linear(weight, state.get("proj.bias"), dtype), jnp.asarray(state["norm.weight"], dtype),
                        jnp.asarray(state["norm.bias"], dtype)))


class IPAdapterAttention(AbstractAttention):
    """A UNet cross-attention (``attn2``) with IP-Adapters: the text attention of :class:`~eqxdiff.nn.CrossAttention`
    plus, for each adapter ``i``, the queries' attention to its image tokens through ``to_k_ip[i]`` / ``to_v_ip[i]``,
    times ``ip_scale[i]``, summed before ``to_out`` (diffusers' ``IPAdapterAttnProcessor2_0``); a masked adapter's
    image ``j`` also times ``ip_image_scale[i, j]`` (diffusers' per-image scales; 1 for each image where the adapter's
    scale is a number; ``K``, the most per-image scales set, is a shape: the first per-image scales compile once,
    other values nothing). The context is the
    text tokens followed by each adapter's image tokens: ``num_images[i]`` images of ``num_tokens[i]`` tokens each,
    one after the other (diffusers' ``[batch, images, tokens, dim]`` through ``to_k_ip``, which attends to the images'
    tokens together). The image counts are shapes (:func:`with_image_counts`; a new count compiles)."""

    PARAM_AXES: ClassVar = {"ip_scale": (None,), "ip_image_scale": (None, None)}  # a few scalars: replicated

    to_q: Linear
    to_k: Linear
    to_v: Linear
    to_out: Linear
    to_k_ip: tuple[Linear, ...]
    to_v_ip: tuple[Linear, ...]
    ip_scale: Float[Array, " adapters"]
    ip_image_scale: Float[Array, "adapters K"]
    num_tokens: tuple[int, ...] = eqx.field(static=True)
    num_images: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, attention: CrossAttention, to_k_ip: Sequence[Linear], to_v_ip: Sequence[Linear],
                 num_tokens: Sequence[int]):
        if attention.norm_q is not None or attention.norm_k is not None:
            raise ValueError("IPAdapterAttention: the UNet's cross-attention has QK norms, which IP-Adapter does not")
        self._init_settings(heads=attention.heads, scale=attention.scale, names=attention.names,
                            token_axis=attention.token_axis, implementation=attention.implementation)
        self.plan = attention.plan
        self.to_q, self.to_k, self.to_v, self.to_out = attention.to_q, attention.to_k, attention.to_v, attention.to_out
        self.to_k_ip, self.to_v_ip = tuple(to_k_ip), tuple(to_v_ip)
        self.ip_scale = jnp.ones((len(self.to_k_ip),), jnp.float32)
        self.ip_image_scale = jnp.ones((len(self.to_k_ip), 1), jnp.float32)
        self.num_tokens = tuple(int(n) for n in num_tokens)
        self.num_images = (1,) * len(self.num_tokens)

    @property
    def image_tokens(self) -> tuple[int, ...]:
        """Each adapter's image tokens at the end of the context: its images times its tokens per image."""
        return tuple(n * images for n, images in zip(self.num_tokens, self.num_images))

    @property
    def base(self) -> CrossAttention:
        """The cross-attention without its adapters."""
        out = eqx.filter_eval_shape(lambda: CrossAttention(
            self.to_q.in_features, self.to_k.in_features, heads=self.heads,
            dim_head=self.to_q.out_features // self.heads,
            scale=self.scale, names=self.names, token_axis=self.token_axis, implementation=self.implementation,
            key=jax.random.key(0)))
        out = eqx.tree_at(lambda a: (a.to_q, a.to_k, a.to_v, a.to_out), out,
                          (self.to_q, self.to_k, self.to_v, self.to_out))
        return replace_static(out, plan=self.plan)

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"], *,
                 mask: Bool[Array, "batch ctx_seq"] | None = None,
                 ip_adapter_masks: Sequence[Mapping[int, Array] | None] | None = None,
                 ) -> Float[Array, "batch seq out"]:
        """``ip_adapter_masks`` (diffusers' name): per adapter ``None`` or its images' weights by query count
        (``{seq: [batch, images, seq]}``: the masks downsampled to each cross-attention's tokens, times any per-image
        scales; :func:`eqxdiff.pipelines._ip_adapter_masks.mask_weights`). An adapter with weights attends to each of
        its images alone (its own softmax), each output times its weights, summed; without, to its images' tokens
        together."""
        counts = self.image_tokens
        text = context.shape[1] - sum(counts)
        if text < 1:
            raise ValueError(f"IPAdapterAttention: the context has {context.shape[1]} tokens, but the IP-Adapters "
                             f"take {sum(counts)} image tokens after the text: pass the projected image tokens")
        masks = (None,) * len(counts) if ip_adapter_masks is None else tuple(ip_adapter_masks)
        if len(masks) != len(counts):
            raise ValueError(f"IPAdapterAttention: {len(masks)} ip_adapter_masks for {len(counts)} IP-Adapter(s); "
                             "give one entry (None: no mask) per adapter")
        q = self._heads(self.to_q(x))
        tokens = context[:, :text]
        out = attend(self, q, self._heads(self.to_k(tokens)), self._heads(self.to_v(tokens)),
                     mask=None if mask is None else mask[:, :text])
        start = text
        for i, (to_k, to_v, n, weights) in enumerate(zip(self.to_k_ip, self.to_v_ip, counts, masks)):
            k, v = to_k(context[:, start:start + n]), to_v(context[:, start:start + n])
            start += n
            if weights is None:
                ip = attend(self, q, self._heads(k), self._heads(v))
            else:
                ip = self._masked(q, k, v, self._weights(weights, x.shape[1], i), self.num_tokens[i],
                                  self.ip_image_scale[i])
            out = out + self.ip_scale[i].astype(out.dtype) * ip
        return self._output(self.to_out, out)

    def _weights(self, weights: Mapping[int, Array], seq: int, adapter: int) -> Array:
        if seq not in weights:
            raise ValueError(f"IPAdapterAttention: ip_adapter_masks[{adapter}] holds weights for {sorted(weights)} "
                             f"queries, this cross-attention has {seq}: downsample the masks for the latents' size")
        return weights[seq]

    def _masked(self, q: Array, k: Array, v: Array, weights: Array, per_image: int, scales: Array) -> Array:
        """Each image's attention alone (keys ``k`` / values ``v`` ``[batch, images * per_image, inner]``), times
        its ``weights`` ``[batch, images, seq]`` and its scale (``scales[j]``; one scale: every image's), summed
        (diffusers' masked path)."""
        if weights.shape[1] * per_image != k.shape[1]:
            raise ValueError(f"IPAdapterAttention: masks for {weights.shape[1]} images, the adapter reads "
                             f"{k.shape[1] // per_image}: give one mask per image")
        out = 0
        for j in range(weights.shape[1]):
            part = slice(j * per_image, (j + 1) * per_image)
            ip = attend(self, q, self._heads(k[:, part]), self._heads(v[:, part]))
            scale = scales[j if j < scales.shape[0] else 0]
            out = out + ip * (weights[:, j, :, None] * scale).astype(ip.dtype)
        return out


def _transformers(unet) -> list:
    """The UNet's spatial transformers in diffusers' ``attn_processors`` order: down blocks, up blocks, mid block."""
    blocks = [*unet.down_blocks, *unet.up_blocks, *([unet.mid_block] if unet.mid_block is not None else [])]
    return [t for block in blocks for t in (block.attentions or ())]


def cross_attention_blocks(unet) -> list[tuple[str, int, int]]:
    """``(part, block, attention)`` of each cross-attention in diffusers' order: ``part`` ``"down"``, ``"up"`` or
    ``"mid"``, the block's index in it and the spatial transformer's index in the block (diffusers'
    ``down_blocks.{block}.attentions.{attention}``; every transformer block inside counted once each)."""
    out = []
    for part, blocks in (("down", unet.down_blocks), ("up", unet.up_blocks),
                         ("mid", [unet.mid_block] if unet.mid_block is not None else [])):
        for b, block in enumerate(blocks):
            for a, transformer in enumerate(block.attentions or ()):
                out.extend([(part, b, a)] * len(transformer.transformer_blocks))
    return out


def cross_attention_paths(unet) -> list:
    """Functions ``f(unet) -> attn2``, one per cross-attention, in diffusers' order (unstacked transformer blocks)."""
    paths = []
    for t_index, transformer in enumerate(_transformers(unet)):
        if isinstance(transformer.transformer_blocks, nn.Stacked):
            raise ValueError("add_ip_adapters: unstack the UNet first (eqxdiff.nn.scan_layers(unet, scan=False))")
        for b_index in range(len(transformer.transformer_blocks)):
            paths.append(lambda u, t=t_index, b=b_index: _transformers(u)[t].transformer_blocks[b].attn2)
    return paths


def _stacked(unet) -> bool:
    return any(isinstance(t.transformer_blocks, nn.Stacked) for t in _transformers(unet))


def _each_attention(unet, fn):
    """``unet`` with ``fn(i, attn2)`` in place of each cross-attention ``i`` (diffusers' order), unstacked and
    restacked around it if the UNet scans its transformer blocks."""
    stacked = _stacked(unet)
    if stacked:
        unet = nn.scan_layers(unet, scan=False)
    paths = cross_attention_paths(unet)
    for i, path in enumerate(paths):
        unet = eqx.tree_at(path, unet, fn(i, path(unet)))
    return nn.scan_layers(unet, scan=True) if stacked else unet


def add_ip_adapters(unet, layers: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], num_tokens: Sequence[int]):
    """``unet`` with IP-Adapters in its cross-attentions: ``layers[a][i]`` is adapter ``a``'s ``(to_k_ip,
    to_v_ip)`` weights (``[inner, cross_attention_dim]``) of cross-attention ``i`` (diffusers' order), ``num_tokens[a]``
    its image tokens. Adapters already there are replaced; every scale starts at 1."""
    unet = remove_ip_adapters(unet)
    dtype = unet.conv_in.weight.dtype

    def patch(i, attention):
        k = [_linear(np.asarray(adapter[i][0]), None, dtype, ("heads", "embed")) for adapter in layers]
        v = [_linear(np.asarray(adapter[i][1]), None, dtype, ("heads", "embed")) for adapter in layers]
        for name, lin in (("to_k_ip", k[0]), ("to_v_ip", v[0])):
            want = (attention.to_k.out_features, attention.to_k.in_features)
            if tuple(lin.weight.shape) != want:
                raise ValueError(f"cross-attention {i}'s {name} weight has shape {tuple(lin.weight.shape)}, the UNet "
                                 f"wants {want}: this IP-Adapter was made for another UNet")
        return IPAdapterAttention(attention, k, v, num_tokens)

    return _each_attention(unet, patch)


def remove_ip_adapters(unet):
    """``unet`` with plain cross-attentions again (unchanged if it holds no IP-Adapters)."""
    if not has_ip_adapters(unet):
        return unet
    return _each_attention(unet, lambda i, a: a.base if isinstance(a, IPAdapterAttention) else a)


def has_ip_adapters(unet) -> bool:
    """Whether ``unet``'s cross-attentions hold IP-Adapters."""
    for transformer in _transformers(unet):
        blocks = transformer.transformer_blocks
        first = blocks.layers if isinstance(blocks, nn.Stacked) else blocks[0]
        return isinstance(first.attn2, IPAdapterAttention)
    return False


def _first_attention(unet):
    for transformer in _transformers(unet):
        blocks = transformer.transformer_blocks
        return (blocks.layers if isinstance(blocks, nn.Stacked) else blocks[0]).attn2
    return None


def image_token_count(unet) -> int:
    """How many image tokens the IP-Adapters in ``unet`` read at the end of its context (0 without adapters)."""
    attention = _first_attention(unet)
    if not isinstance(attention, IPAdapterAttention):
        return 0
    return sum(attention.image_tokens)


def image_counts(unet) -> tuple[int, ...]:
    """How many images each IP-Adapter in ``unet`` reads (:func:`with_image_counts`); ``()`` without adapters."""
    attention = _first_attention(unet)
    return attention.num_images if isinstance(attention, IPAdapterAttention) else ()


def with_image_counts(unet, counts: Sequence[int]):
    """``unet`` with its IP-Adapters reading ``counts[a]`` images' tokens for adapter ``a`` (static: a new count
    compiles; the arrays are the same)."""
    attention = _first_attention(unet)
    if not isinstance(attention, IPAdapterAttention):
        raise ValueError("with_image_counts: the UNet holds no IP-Adapters")
    counts = tuple(int(c) for c in counts)
    if len(counts) != len(attention.num_tokens) or min(counts) < 1:
        raise ValueError(f"with_image_counts: {counts} for {len(attention.num_tokens)} IP-Adapter(s); give one "
                         "count >= 1 per adapter")
    if counts == attention.num_images:
        return unet
    return map_modules(lambda m: replace_static(m, num_images=counts) if isinstance(m, IPAdapterAttention) else m,
                       unet)


def _scale_sites(unet, name: str = "ip_scale"):
    """``(where, layers)`` per spatial transformer: ``where(unet)`` its adapter scales ``name`` (one ``[layers,
    adapters, ...]`` array when its blocks are stacked, else a list of ``[adapters, ...]`` arrays), in diffusers'
    order."""
    sites = []
    for t, transformer in enumerate(_transformers(unet)):
        blocks = transformer.transformer_blocks
        if isinstance(blocks, nn.Stacked):
            sites.append((lambda u, t=t: getattr(_transformers(u)[t].transformer_blocks.layers.attn2, name),
                          len(blocks)))
        else:
            sites.append((lambda u, t=t: [getattr(b.attn2, name) for b in _transformers(u)[t].transformer_blocks],
                          len(blocks)))
    return sites


def ip_adapter_scales(unet, image_scales: bool = False) -> np.ndarray:
    """The adapter scales ``[cross-attentions, adapters]`` (diffusers' order); with ``image_scales`` the masked
    images' scales ``[cross-attentions, adapters, K]`` instead."""
    sites = _scale_sites(unet, "ip_image_scale" if image_scales else "ip_scale")
    return np.concatenate([np.asarray(jax.device_get(where(unet))) for where, _ in sites])


def with_ip_adapter_scales(unet, scales: np.ndarray, image_scales: np.ndarray | None = None):
    """``unet`` with the adapter scales ``scales`` ``[cross-attentions, adapters]`` and, if given, the masked
    images' scales ``image_scales`` ``[cross-attentions, adapters, K]`` (values only, placed as the old ones: nothing
    compiles; a new ``K`` is a new shape)."""
    for name, values in (("ip_scale", scales), ("ip_image_scale", image_scales)):
        if values is None:
            continue
        values, start = np.asarray(values, np.float32), 0
        for where, n in _scale_sites(unet, name):
            old, part = where(unet), values[start:start + n]
            start += n
            new = (nn.place_like(part, old) if not isinstance(old, list) else
                   [nn.place_like(row, o) for row, o in zip(part, old)])
            unet = eqx.tree_at(where, unet, new)
    return unet


def load_ip_adapters(unet, state_dicts: Sequence[Mapping[str, Mapping[str, np.ndarray]]]):
    """``(unet, projections)``: ``unet`` with the IP-Adapters of ``state_dicts`` (each ``{"image_proj": {...},
    "ip_adapter": {...}}``, the original names diffusers' ``load_ip_adapter`` reads: ``ip_adapter`` holds
    ``{1, 3, 5, ...}.to_k_ip.weight`` / ``.to_v_ip.weight``) in its cross-attentions, and their image projections.
    ``ValueError`` naming the tensors for a file made for another UNet."""
    count = sum(len(t.transformer_blocks) for t in _transformers(unet))
    dtype, width = unet.conv_in.weight.dtype, unet.config.cross_attention_dim
    projections, layers = [], []
    for a, state in enumerate(state_dicts):
        ip = state["ip_adapter"]
        wanted = {f"{2 * i + 1}.to_{kv}_ip.weight" for i in range(count) for kv in "kv"}
        missing, unexpected = sorted(wanted - set(ip)), sorted(set(ip) - wanted)
        if missing or unexpected:
            raise ValueError(f"IP-Adapter {a}: the UNet has {count} cross-attentions (ip_adapter.1 ... "
                             f"ip_adapter.{2 * count - 1}); the file misses {missing[:4]} and has unexpected "
                             f"{unexpected[:4]}: it was made for another UNet (SD 1.x/2.x vs SDXL?)")
        layers.append([(ip[f"{2 * i + 1}.to_k_ip.weight"], ip[f"{2 * i + 1}.to_v_ip.weight"]) for i in range(count)])
        projection = image_projection(state["image_proj"], dtype=dtype)
        if projection.out_dim != width:
            raise ValueError(f"IP-Adapter {a}: its image projection makes tokens of width "
                             f"{projection.out_dim}, the UNet's cross_attention_dim is {width}: it was "
                             "made for another UNet")
        projections.append(projection)
    return add_ip_adapters(unet, layers, [p.num_tokens for p in projections]), tuple(projections)
