"""Black Forest Labs' control LoRAs (FLUX.1-Canny-dev-lora / Depth-dev-lora layout) on a FLUX.1-dev pipeline, on the
transformer against diffusers (<= 1e-4): ``img_in`` / ``x_embedder``'s ``lora_A`` reads twice the inputs (the
transformer is widened with zero columns, its ``in_channels`` doubled, as diffusers'
``_maybe_expand_transformer_param_shape_or_error_``), every LoRA has a ``lora_B.bias``, and the q/k RMSNorms'
scales are replaced (``.scale`` in BFL's names, ``.weight`` in diffusers'; diffusers' ``_load_norm_into_transformer``).

The file is written in BFL's names (fused ``qkv`` / ``linear1`` with one ``lora_A``, the final modulation's (shift,
scale) rows) and in diffusers/PEFT names (what diffusers' ``_convert_bfl_flux_control_lora_to_diffusers`` makes of
it, written out here: that converter hard-codes FLUX.1's sizes); diffusers loads the latter. Unfused and fused on the
transformer; end to end as FluxControlPipeline against diffusers' (<= 2/255).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.autoencoders import vae as diffusers_vae

import eqxdiff
from eqxdiff.loading import CheckpointError
from eqxdiff.models import flux as flux_model
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.flux_control import FluxControlPipeline

from . import _lora_files as files
from . import _tiny_flux_pipeline as tiny
from ._util import assert_close, nhwc_to_nchw
from .test_flux_control import _pixels_off
from .test_lora_flux import bfl_layers

RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 16, 8)).astype(np.float32)  # 16 packed tokens of noisy + control latents (4 + 4)
TXT = RNG.standard_normal((1, 6, 32)).astype(np.float32)
POOLED = RNG.standard_normal((1, 32)).astype(np.float32)
IMG_IDS, TXT_IDS = flux_model.image_ids(4, 4), flux_model.text_ids(6)
PROMPTS = ["a red cat", "two dogs"]
NORMS = {"img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
         "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k"}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    tiny.build(folder, "dev")
    return folder, eqxdiff.load_pipeline(folder), tmp_path_factory.mktemp("control_loras")


def control_lora(ref, rand, rank=4) -> tuple[dict, dict]:
    """``(BFL names, diffusers names)`` of one random control LoRA: every BFL layer of :func:`bfl_layers` with a
    ``lora_B.bias``, ``img_in`` reading twice the inputs, and new q/k norm scales."""
    modules = dict(ref.transformer.named_modules())
    bfl, peft = {}, {}
    for name, parts in bfl_layers(ref).items():
        layers = [modules[p] for p in parts]
        width = layers[0].weight.shape[1] * (2 if name == "img_in" else 1)
        down = rand(rank, width, scale=1 / np.sqrt(width))
        ups, biases = [rand.up(rank, m) for m in layers], [rand.vector(m.weight.shape[0]) for m in layers]
        for part, up, bias in zip(parts, ups, biases):
            peft.update({f"transformer.{part}.lora_A.weight": down.clone(), f"transformer.{part}.lora_B.weight": up,
                         f"transformer.{part}.lora_B.bias": bias})
        up, bias = torch.cat(ups), torch.cat(biases)
        if name == "final_layer.adaLN_modulation.1":  # diffusers' (scale, shift) rows are BFL's (shift, scale)
            up, bias = torch.cat(up.chunk(2)[::-1]), torch.cat(bias.chunk(2)[::-1])
        bfl.update({f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": up, f"{name}.lora_B.bias": bias})
    blocks = [(f"double_blocks.{i}.", f"transformer_blocks.{i}.", NORMS)
              for i in range(len(ref.transformer.transformer_blocks))]
    blocks += [(f"single_blocks.{i}.", f"single_transformer_blocks.{i}.",
                {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"})
               for i in range(len(ref.transformer.single_transformer_blocks))]
    for b, d, norms in blocks:
        for theirs, ours in norms.items():
            scale = 1 + rand.vector(modules[d + ours].weight.shape[0], 0.3)
            bfl[f"{b}{theirs}.scale"], peft[f"transformer.{d}{ours}.weight"] = scale, scale
    return bfl, peft


def _theirs(transformer, x) -> np.ndarray:
    with torch.no_grad():
        return transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(TXT),
                           pooled_projections=torch.from_numpy(POOLED), timestep=torch.tensor([0.5]),
                           img_ids=torch.from_numpy(IMG_IDS).float(), txt_ids=torch.from_numpy(TXT_IDS).float(),
                           guidance=torch.tensor([3.5]), return_dict=False)[0].numpy()


@eqx.filter_jit
def _forward(transformer, x):
    rope = transformer.rotary_embedding(IMG_IDS, TXT_IDS)
    return transformer(x, jnp.asarray(TXT), jnp.asarray(POOLED), jnp.asarray([0.5]), rope=rope,
                       guidance=jnp.asarray([3.5]))


def test_control_lora_matches_diffusers_and_unloads(flux):
    """The BFL file and the diffusers-named file each give diffusers' widened, norm-replaced, adapted transformer;
    the pipeline runs as FluxControlPipeline (from_pipe: the adapters come along); strength 0 is the base model on
    the noisy channels (the norms follow the adapter, unlike diffusers'); unload gives back the very model loaded
    before, the base's width and norms. A transformer with scanned blocks takes the same file."""
    import diffusers

    folder, pipe, out = flux
    ref = diffusers.FluxPipeline.from_pretrained(folder)
    bfl, peft = control_lora(ref, files.Rand(90))
    bfl_path, peft_path = files.save(bfl, out / "bfl.safetensors"), files.save(peft, out / "peft.safetensors")
    ref.load_lora_weights(str(peft_path))
    assert ref.transformer.config.in_channels == 8 and ref.transformer.x_embedder.in_features == 8
    expected = _theirs(ref.transformer, X)

    base = pipe.transformer
    plain = np.asarray(_forward(base, X[..., :4]))
    for path in (bfl_path, peft_path):
        pipe.load_lora_weights(path, adapter_name="control")
        try:
            config = pipe.transformer.config
            assert (config.in_channels, config.out_channels, pipe.transformer.x_embedder.in_features) == (8, 4, 8)
            got = np.asarray(_forward(pipe.transformer, X))
            assert_close(got, expected, 1e-4, f"control LoRA from {path.name}")
            assert not np.allclose(got, plain, atol=1e-3)
            pipe.fuse_lora()  # the norms' differences too: diffusers' at strength 1
            assert_close(np.asarray(_forward(pipe.transformer, X)), expected, 1e-4, f"fused {path.name}")
            pipe.unfuse_lora()
            control = FluxControlPipeline.from_pipe(pipe)  # the adapters come along, switchable there
            assert control.latent_channels == 1 and control.transformer is pipe.transformer
            control._check_model()
            assert control.get_active_adapters() == ["control"]
            control.set_adapters("control", 0.0)
            assert_close(np.asarray(_forward(control.transformer, X)), plain, 1e-5, "strength 0")
            control.unload_lora_weights()
            assert control.transformer is base and pipe.get_active_adapters() == ["control"]
        finally:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
        assert pipe.transformer is base and base.config.in_channels == 4

    # scanned blocks: the norms' new scales per stacked layer
    scanned = type(pipe).from_pipe(pipe, transformer=eqxdiff.load(folder, "transformer", scan_layers=True))
    scanned.load_lora_weights(bfl_path)
    assert_close(np.asarray(_forward(scanned.transformer, X)), expected, 1e-4, "control LoRA, scanned blocks")


def test_control_lora_errors(flux):
    """A wider input the model does not declare widenable, and a whole weight of a projection (not a norm), are
    refused naming them; nothing is changed."""
    _, pipe, out = flux
    base = pipe.transformer
    rand = files.Rand(91)
    wide = {"transformer.context_embedder.lora_A.weight": rand(2, 64), "transformer.context_embedder.lora_B.weight":
            rand(32, 2)}
    with pytest.raises(CheckpointError, match="transformer layer 'context_embedder' takes 32 inputs but the file's "
                                              "adapter reads 64: FluxTransformer2DModel does not declare"):
        pipe.load_lora_weights(files.save(wide, out / "wide.safetensors"))
    whole = {"transformer.proj_out.weight": rand(4, 32), "transformer.x_embedder.lora_A.weight": rand(2, 4),
             "transformer.x_embedder.lora_B.weight": rand(32, 2)}
    with pytest.raises(CheckpointError, match=r"1 of the 3 tensors .* adapt nothing .*'transformer.proj_out.weight'"):
        pipe.load_lora_weights(files.save(whole, out / "whole.safetensors"))
    mixed = {"transformer.proj_out.weight": rand(4, 32), "transformer.proj_out.lora_A.weight": rand(2, 32)}
    with pytest.raises(CheckpointError, match="module 'transformer.proj_out' holds tensors of two adapter kinds"):
        pipe.load_lora_weights(files.save(mixed, out / "mixed.safetensors"))
    assert pipe.transformer is base and not pipe.get_list_adapters()


def test_control_lora_pipeline_matches_diffusers(flux, monkeypatch):
    """End to end: the BFL file in the dev pipeline run as FluxControlPipeline gives diffusers' FluxControlPipeline
    (from_pipe after its load_lora_weights of the same LoRA in its names) within 2/255, from the same latents and
    posterior noise of the control latents."""
    import diffusers

    folder, pipe, out = flux
    ref = diffusers.FluxPipeline.from_pretrained(folder)
    bfl, peft = control_lora(ref, files.Rand(92))
    ref.load_lora_weights(str(files.save(peft, out / "peft_e2e.safetensors")))
    reference = diffusers.FluxControlPipeline.from_pipe(ref)
    reference.set_progress_bar_config(disable=True)
    noise = np.random.default_rng(3).standard_normal((2, 8, 8, 1)).astype(np.float32)
    images = np.random.default_rng(4).random((2, 8, 8, 3), dtype=np.float32)
    posterior = nhwc_to_nchw(np.array(noise_draws(jax.random.key(7), noise.shape).image))
    monkeypatch.setattr(diffusers_vae.DiagonalGaussianDistribution, "sample",
                        lambda dist, generator=None: dist.mean + dist.std * posterior)
    kwargs = dict(guidance_scale=4.0, num_inference_steps=3, max_sequence_length=12, height=8, width=8)
    with torch.no_grad():
        expected = reference(prompt=PROMPTS, control_image=images, output_type="np",
                             latents=reference._pack_latents(nhwc_to_nchw(noise), 2, 1, 8, 8), **kwargs).images
    pipe.load_lora_weights(files.save(bfl, out / "bfl_e2e.safetensors"))
    try:
        ours = FluxControlPipeline.from_pipe(pipe)(PROMPTS, control_image=images, latents=noise, seed=7,
                                                   progress=False, **kwargs)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert _pixels_off(ours, expected) <= 2 and np.std(ours) > 1


def test_the_check_before_loading_takes_a_control_lora(flux):
    """eqxdiff-generate's check before loading (abstract models, no weight read) passes a control LoRA, its
    widening and norm scales included (ranks padded to --lora-max-rank), and refuses what loading refuses."""
    import diffusers

    from eqxdiff.cli._generate_flags import config_reader
    from eqxdiff.cli._lora import abstract_models
    from eqxdiff.pipelines.flux import FluxPipeline

    folder, _, out = flux
    bfl, _ = control_lora(diffusers.FluxPipeline.from_pretrained(folder), files.Rand(93))
    models = abstract_models(FluxPipeline, config_reader(str(folder)))
    path = files.save(bfl, out / "bfl_check.safetensors")
    FluxPipeline.check_lora_file(path, models, max_rank=8)
    for scan in (False, True):
        FluxPipeline.check_lora_file(path, abstract_models(FluxPipeline, config_reader(str(folder)), scan=scan))
    wide = {"transformer.context_embedder.lora_A.weight": torch.ones(2, 64),
            "transformer.context_embedder.lora_B.weight": torch.ones(32, 2)}
    with pytest.raises(CheckpointError, match="does not declare that input widenable"):
        FluxPipeline.check_lora_file(files.save(wide, out / "wide_check.safetensors"), models)
