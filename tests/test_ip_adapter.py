"""IP-Adapter in the UNet (eqxdiff.models.ip_adapter) against diffusers' ``_load_ip_adapter_weights`` /
``IPAdapterAttnProcessor2_0`` at float32 on tiny random UNets, one with stacked (scanned) transformer blocks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.models import ip_adapter as ipa

from ._ip_adapter_files import EMBED, as_numpy, ip_adapter_state, plus_image_proj
from ._util import assert_close, nchw_to_nhwc, randomize_torch

CONFIGS = {
    "sd": dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=4,
               norm_num_groups=8),
    "stacked": dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
                    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24,
                    attention_head_dim=(2, 4), norm_num_groups=8, transformer_layers_per_block=2,
                    use_linear_projection=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def unets(request, tmp_path_factory):
    """(diffusers UNet with two random IP-Adapters, eqxdiff UNet loaded without them, the two states, name)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    reference = UNet2DConditionModel(**CONFIGS[request.param]).eval()
    randomize_torch(reference, seed=1)
    folder = tmp_path_factory.mktemp(f"ip_unet_{request.param}")
    reference.save_pretrained(folder)
    ours = eqxdiff.load(folder)
    if request.param == "stacked":
        ours = eqxdiff.nn.scan_layers(ours, scan=True)
    states = [ip_adapter_state(reference, seed=s) for s in (2, 3)]
    reference._load_ip_adapter_weights(states)
    return reference, ours, states, request.param


@eqx.filter_jit
def _run(unet, projections, sample, t, text, image_embeds):
    tokens = [p(e) for p, e in zip(projections, image_embeds)]
    return unet(sample, t, jnp.concatenate([text, *tokens], axis=1))


def _inputs(reference, seed=0):
    rng = np.random.default_rng(seed)
    width = reference.config.cross_attention_dim
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    text = rng.standard_normal((2, 5, width)).astype(np.float32)
    embeds = [rng.standard_normal((2, EMBED)).astype(np.float32) for _ in range(2)]
    return sample, text, embeds


def _reference(reference, sample, text, embeds, scale, *, images=False, masks=None):
    """diffusers' UNet at ``scale`` with ``embeds`` one image per adapter (``images``: ``[batch, images, ...]``),
    and ``masks`` its ``ip_adapter_masks``."""
    for proc in reference.attn_processors.values():
        if hasattr(proc, "scale"):
            proc.scale = list(scale)
    image_embeds = [torch.from_numpy(e) if images else torch.from_numpy(e)[:, None] for e in embeds]
    kwargs = None if masks is None else {"ip_adapter_masks": [m if m is None else torch.from_numpy(m) for m in masks]}
    with torch.no_grad():
        out = reference(torch.from_numpy(sample), 500, torch.from_numpy(text), cross_attention_kwargs=kwargs,
                        added_cond_kwargs={"image_embeds": image_embeds}).sample
    return nchw_to_nhwc(out)


def test_unet_with_two_ip_adapters_matches_diffusers(unets):
    reference, ours, states, name = unets
    unet, projections = ipa.load_ip_adapters(ours, [as_numpy(s) for s in states])
    assert isinstance(unet.down_blocks[0].attentions[0].transformer_blocks,
                      eqxdiff.nn.Stacked if name == "stacked" else tuple)
    sample, text, embeds = _inputs(reference)
    for scale in ((1.0, 1.0), (0.6, 0.3)):
        rows = np.broadcast_to(np.asarray(scale, np.float32), ipa.ip_adapter_scales(unet).shape)
        unet = ipa.with_ip_adapter_scales(unet, rows)
        got = _run(unet, projections, nchw_to_nhwc(sample), 500,
                   jnp.asarray(text), [jnp.asarray(e) for e in embeds])
        assert_close(got, _reference(reference, sample, text, embeds, scale), 1e-4, f"{name} UNet at scale {scale}")
    # the IP tokens matter, and a plain UNet again once they are removed
    plain = ipa.remove_ip_adapters(unet)
    assert not ipa.has_ip_adapters(plain) and ipa.has_ip_adapters(unet)
    assert jax.tree.structure(plain) == jax.tree.structure(ours)


def test_image_projection_matches_diffusers(unets):
    from diffusers.models.embeddings import ImageProjection

    reference, _, states, _ = unets
    proj = ImageProjection(EMBED, reference.config.cross_attention_dim, 4).eval()
    proj.load_state_dict({k.replace("proj", "image_embeds"): v for k, v in states[0]["image_proj"].items()})
    x = np.random.default_rng(1).standard_normal((3, EMBED)).astype(np.float32)
    with torch.no_grad():
        want = proj(torch.from_numpy(x)).numpy()
    assert_close(ipa.image_projection(as_numpy(states[0])["image_proj"])(jnp.asarray(x)), want, 1e-5,
                 "image projection")


def test_adapters_for_another_unet_are_refused(unets):
    reference, ours, states, _ = unets
    state = as_numpy(states[0])
    wrong = {**state, "ip_adapter": {k: v for k, v in state["ip_adapter"].items() if not k.startswith("1.")}}
    with pytest.raises(ValueError, match="made for another UNet"):
        ipa.load_ip_adapters(ours, [wrong])
    face = {**state, "image_proj": {"proj.0.weight": np.zeros((8, 4), np.float32)}}
    with pytest.raises(ValueError, match="Full-face and FaceID variants are not supported"):
        ipa.load_ip_adapters(ours, [face])
    plus = {**state, "image_proj": {"latents": np.zeros((1, 16, 8), np.float32)}}
    with pytest.raises(ValueError, match=r"Plus image_proj misses \['proj_in.weight'"):
        ipa.load_ip_adapters(ours, [plus])


def test_plus_projection_and_unet_match_diffusers(unets):
    """IP-Adapter Plus (the Resampler) beside a plain adapter: diffusers' converted projection and UNet."""
    from diffusers.models.embeddings import MultiIPAdapterImageProjection

    reference, ours, states, name = unets
    width = reference.config.cross_attention_dim
    plus = {"image_proj": plus_image_proj(width, seed=7), "ip_adapter": states[1]["ip_adapter"]}
    both = [states[0], plus]
    saved = reference.encoder_hid_proj
    try:
        reference.encoder_hid_proj = MultiIPAdapterImageProjection(
            [reference._convert_ip_adapter_image_proj_to_diffusers(s["image_proj"], low_cpu_mem_usage=False)
             for s in both]).eval()
        unet, projections = ipa.load_ip_adapters(ours, [as_numpy(s) for s in both])
        assert isinstance(projections[1], ipa.IPAdapterPlusImageProjection) and projections[1].num_tokens == 6
        rng = np.random.default_rng(3)
        sample, text, embeds = _inputs(reference)
        embeds = [embeds[0], rng.standard_normal((2, 9, 16)).astype(np.float32)]
        with torch.no_grad():
            want = reference.encoder_hid_proj.image_projection_layers[1](torch.from_numpy(embeds[1])).numpy()
        assert_close(projections[1](jnp.asarray(embeds[1])), want, 1e-5, "Plus projection")
        got = _run(unet, projections, nchw_to_nhwc(sample), 500, jnp.asarray(text), [jnp.asarray(e) for e in embeds])
        assert_close(got, _reference(reference, sample, text, embeds, (1.0, 1.0)), 1e-4, f"{name} UNet with Plus")
    finally:
        reference.encoder_hid_proj = saved


def test_adapters_declare_logical_axes_and_shard_on_a_mesh(unets):
    """Every IP-Adapter parameter (the attention's scales and projections, Plus's queries) has logical axes, so a
    pipeline on a mesh places them (load_ip_adapter's shard_params); new scales keep the sharding."""
    from eqxdiff.core import leaf_specs
    from eqxdiff.parallel import MeshConfig, make_mesh, shard_params

    reference, ours, states, _ = unets
    plus = {"image_proj": plus_image_proj(reference.config.cross_attention_dim, seed=7),
            "ip_adapter": states[1]["ip_adapter"]}
    unet, projections = ipa.load_ip_adapters(ours, [as_numpy(states[0]), as_numpy(plus)])
    _, specs, _ = leaf_specs((unet, projections))
    assert all(s.axes is not None for s in specs)
    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1))
    unet, projections = shard_params(unet, mesh), shard_params(projections, mesh)
    scaled = ipa.with_ip_adapter_scales(unet, np.full(ipa.ip_adapter_scales(unet).shape, 0.5, np.float32))
    old = jax.tree.leaves(unet, is_leaf=lambda x: isinstance(x, ipa.IPAdapterAttention))
    new = jax.tree.leaves(scaled, is_leaf=lambda x: isinstance(x, ipa.IPAdapterAttention))
    pairs = [(a.ip_scale, b.ip_scale) for a, b in zip(old, new) if isinstance(a, ipa.IPAdapterAttention)]
    assert pairs and all(b.sharding == a.sharding for a, b in pairs)
    assert np.all(np.asarray(pairs[0][1]) == 0.5)


@eqx.filter_jit
def _run_images(unet, projections, sample, t, text, image_embeds, cross_attention_kwargs=None):
    """``_run`` with ``[batch, images, ...]`` embeddings: each image projected alone, its tokens after the last's."""
    tokens = []
    for p, e in zip(projections, image_embeds):
        out = p(e.reshape(-1, *e.shape[2:]))
        tokens.append(out.reshape(e.shape[0], -1, out.shape[-1]))
    return unet(sample, t, jnp.concatenate([text, *tokens], axis=1), cross_attention_kwargs=cross_attention_kwargs)


def test_several_images_per_adapter_match_diffusers(unets):
    """Two adapters with 1 and 2 images: diffusers' ``image_embeds`` ``[batch, images, embed]``, whose attention reads
    each adapter's images' tokens together. Before, the UNet read one image per adapter (the pipeline refused more)."""
    reference, ours, states, name = unets
    rng = np.random.default_rng(4)
    sample, text, _ = _inputs(reference)
    unet, projections = ipa.load_ip_adapters(ours, [as_numpy(s) for s in states])
    embeds = [rng.standard_normal((2, n, EMBED)).astype(np.float32) for n in (1, 2)]
    unet = ipa.with_ip_adapter_scales(unet, np.broadcast_to(np.float32([0.6, 0.3]), ipa.ip_adapter_scales(unet).shape))
    many = ipa.with_image_counts(unet, (1, 2))
    assert ipa.image_token_count(many) == 12 and ipa.image_token_count(unet) == 8
    with pytest.raises(ValueError, match="give one count >= 1 per adapter"):
        ipa.with_image_counts(unet, (2,))
    got = _run_images(many, projections, nchw_to_nhwc(sample), 500, jnp.asarray(text), [jnp.asarray(e) for e in embeds])
    want = _reference(reference, sample, text, embeds, (0.6, 0.3), images=True)
    assert_close(got, want, 1e-4, f"{name} UNet, 1 and 2 images")


def test_several_plus_images_match_diffusers(unets):
    """A plain adapter with 2 images and a Plus one with 3 (the Resampler run per image, the tokens together)."""
    from diffusers.models.embeddings import MultiIPAdapterImageProjection

    reference, ours, states, name = unets
    rng = np.random.default_rng(5)
    sample, text, _ = _inputs(reference)
    plus = {"image_proj": plus_image_proj(reference.config.cross_attention_dim, seed=7),
            "ip_adapter": states[1]["ip_adapter"]}
    saved = reference.encoder_hid_proj
    try:
        reference.encoder_hid_proj = MultiIPAdapterImageProjection(
            [reference._convert_ip_adapter_image_proj_to_diffusers(s["image_proj"], low_cpu_mem_usage=False)
             for s in (states[0], plus)]).eval()
        unet, projections = ipa.load_ip_adapters(ours, [as_numpy(states[0]), as_numpy(plus)])
        embeds = [rng.standard_normal((2, 2, EMBED)).astype(np.float32),
                  rng.standard_normal((2, 3, 9, 16)).astype(np.float32)]
        got = _run_images(ipa.with_image_counts(unet, (2, 3)), projections, nchw_to_nhwc(sample), 500,
                          jnp.asarray(text), [jnp.asarray(e) for e in embeds])
        want = _reference(reference, sample, text, embeds, (1.0, 1.0), images=True)
        assert_close(got, want, 1e-4, f"{name} UNet, 2 plain images and 3 Plus images")
    finally:
        reference.encoder_hid_proj = saved


def test_masked_images_match_diffusers(unets):
    """diffusers' ``cross_attention_kwargs={"ip_adapter_masks": [None, masks]}``: the first adapter's image attended
    as before, the second's two images each alone, weighted by its mask (non-binary values, another aspect than the
    latents': the padded path) resized to every cross-attention's queries and by its own scale; through the stacked
    transformer blocks' scan too. A wrong entry count or a missing resolution is refused naming the fix."""
    from eqxdiff.pipelines._ip_adapter_masks import mask_weights, resolutions

    reference, ours, states, name = unets
    rng = np.random.default_rng(6)
    sample, text, _ = _inputs(reference)
    unet, projections = ipa.load_ip_adapters(ours, [as_numpy(s) for s in states])
    embeds = [rng.standard_normal((2, n, EMBED)).astype(np.float32) for n in (1, 2)]
    masks = [None, rng.random((1, 2, 24, 40)).astype(np.float32)]
    shape = ipa.ip_adapter_scales(unet).shape
    unet = ipa.with_image_counts(ipa.with_ip_adapter_scales(unet, np.broadcast_to(np.float32([0.6, 1.0]), shape),
                                                            np.broadcast_to(np.float32([[1, 1], [0.9, 0.4]]),
                                                                            (*shape, 2))), (1, 2))
    weights = mask_weights(masks, (1, 2), (None, (0.9, 0.4)), 2, resolutions(unet, 8, 8))
    args = (unet, projections, nchw_to_nhwc(sample), 500, jnp.asarray(text), [jnp.asarray(e) for e in embeds])
    got = _run_images(*args, {"ip_adapter_masks": jax.tree.map(jnp.asarray, weights)})
    want = _reference(reference, sample, text, embeds, (0.6, [0.9, 0.4]), images=True, masks=masks)
    assert_close(got, want, 1e-4, f"{name} UNet, the second adapter's 2 images masked")
    with pytest.raises(ValueError, match=r"1 ip_adapter_masks for 2 IP-Adapter\(s\); give one entry"):
        _run_images(*args, {"ip_adapter_masks": (None,)})
    with pytest.raises(ValueError, match=r"holds weights for \[64\] queries, this cross-attention has 16"):
        _run_images(*args, {"ip_adapter_masks": (None, {64: weights[1][64]})})
