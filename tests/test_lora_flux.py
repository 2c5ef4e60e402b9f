"""LoRA files on Flux.1, end to end against a reference (<= 2/255 per pixel, the same latents), and on the models.

- diffusers / PEFT / ai-toolkit (``transformer.``, stray ``.alpha`` keys, CLIP's ``text_encoder.``): diffusers'
  ``load_lora_weights``, unfused (one compile) and fused (the plain program); T5's ``text_encoder_2.``, which
  diffusers does not load for Flux: PEFT's own layers injected into transformers' T5.
- XLabs (``processor.qkv_lora1`` ...): diffusers, fused.
- kohya (``lora_unet_`` + BFL names: one adapter over the fused ``qkv``, ``linear1`` over q, k, v and the MLP, the
  final modulation's (shift, scale)), ``lora_te1_`` / ``lora_te3_``, ComfyUI's dotted ``diffusion_model.`` BFL names
  and fal's Kontext files (``base_model.model.`` + BFL names, ``lora_A`` / ``lora_B``, no alphas): diffusers'
  converters hard-code FLUX.1's 3072 widths, so the reference is their formula in torch
  (``_convert_sd_scripts_to_ai_toolkit`` in diffusers/loaders/lora_conversion_utils.py: the shared ``lora_down``,
  ``lora_up`` cut by rows, ``alpha / rank``, ``swap_scale_shift`` on the final modulation), written out below.
- A model with fused projections (``to_qkv``, ``to_qkv_mlp``) takes separate and BFL-fused adapters alike (block
  diagonal or whole), and a scanned text encoder takes a file skipping a layer at mixed ranks: each equals the plain
  model with the same file.
"""

import contextlib
import copy

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import resolve_class
from eqxdiff.models import flux as flux_model

from . import _lora_files as files
from . import _tiny_flux_pipeline as tiny
from ._util import assert_close, nhwc_to_nchw
from .test_lora_sd import _close, _moved
from .test_recompile import no_compile

CALL = dict(prompt="a red cat", height=8, width=8, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=12)
LATENTS = np.random.default_rng(2).standard_normal((1, 8, 8, 1)).astype(np.float32)
LINEARS = (r"(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|ff(_context)?\.net\.(0\.proj|2)|"
           r"norm1(_context)?\.linear|proj_mlp|proj_out|norm\.linear|x_embedder|context_embedder|linear_[12]|"
           r"norm_out\.linear)$")
TEXT = r"self_attn\.(q|k|v|out)_proj$|mlp\.fc[12]$"
T5 = r"SelfAttention\.[qkvo]$|DenseReluDense\.w[io]$"


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    ref = tiny.build(folder, "dev")
    pipe = eqxdiff.load_pipeline(folder)
    return ref, pipe, _ours(pipe), tmp_path_factory.mktemp("flux_loras"), folder


def _ours(pipe, **extra) -> np.ndarray:
    return np.asarray(pipe(**CALL, latents=LATENTS, progress=False, **extra))


def _theirs(ref, **extra) -> np.ndarray:
    n, h, w, c = LATENTS.shape
    with torch.no_grad():
        return ref(**CALL, latents=ref._pack_latents(nhwc_to_nchw(LATENTS), n, c, h, w), output_type="np",
                   **extra).images


def _fused(pipe, path) -> np.ndarray:
    pipe.load_lora_weights(path)
    try:
        pipe.fuse_lora(components=list(pipe.get_list_adapters()))  # the text encoders too (default: transformer)
        with no_compile("a fused Flux LoRA"):
            return _ours(pipe)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


# -- kohya / BFL: the reference formula ------------------------------------------------------------------------------

def bfl_layers(ref) -> dict[str, list[str]]:
    """BFL module name -> the diffusers modules its rows are, in order (diffusers'
    ``_convert_sd_scripts_to_ai_toolkit`` / ``convert_flux_transformer_checkpoint_to_diffusers`` names)."""
    t, out = ref.transformer, {}
    for i in range(len(t.transformer_blocks)):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        out.update({d + "img_attn.qkv": [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"],
                    d + "txt_attn.qkv": [b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"],
                    d + "img_attn.proj": [b + "attn.to_out.0"], d + "txt_attn.proj": [b + "attn.to_add_out"],
                    d + "img_mlp.0": [b + "ff.net.0.proj"], d + "img_mlp.2": [b + "ff.net.2"],
                    d + "txt_mlp.0": [b + "ff_context.net.0.proj"], d + "txt_mlp.2": [b + "ff_context.net.2"],
                    d + "img_mod.lin": [b + "norm1.linear"], d + "txt_mod.lin": [b + "norm1_context.linear"]})
    for i in range(len(t.single_transformer_blocks)):
        s, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        out.update({s + "linear1": [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"],
                    s + "linear2": [b + "proj_out"], s + "modulation.lin": [b + "norm.linear"]})
    out.update({"img_in": ["x_embedder"], "txt_in": ["context_embedder"], "final_layer.linear": ["proj_out"],
                "final_layer.adaLN_modulation.1": ["norm_out.linear"],
                "time_in.in_layer": ["time_text_embed.timestep_embedder.linear_1"],
                "time_in.out_layer": ["time_text_embed.timestep_embedder.linear_2"],
                "guidance_in.in_layer": ["time_text_embed.guidance_embedder.linear_1"],
                "vector_in.in_layer": ["time_text_embed.text_embedder.linear_1"]})
    return out


def kohya_flux(ref, rand, *, prefix="lora_unet_", dotted=False, rank=4, alpha=2.0) -> tuple[dict, dict]:
    """A kohya (or, ``dotted``, ComfyUI/BFL) Flux file over every BFL layer, and each diffusers module's weight change
    by the formula: ``alpha / rank * up[rows] @ down``, the final modulation's up rows swapped."""
    modules = dict(ref.transformer.named_modules())
    tensors, changes = {}, {}
    for bfl, parts in bfl_layers(ref).items():
        layers = [modules[p] for p in parts]
        down = rand.down(rank, layers[0])
        up = torch.cat([rand.up(rank, m) for m in layers])
        key = prefix + (bfl if dotted else bfl.replace(".", "_"))
        tensors.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                        f"{key}.alpha": torch.tensor(alpha)})
        if bfl == "final_layer.adaLN_modulation.1":  # BFL (shift, scale) -> diffusers (scale, shift)
            shift, scale = up.chunk(2)
            up = torch.cat([scale, shift])
        row = 0
        for name, m in zip(parts, layers):
            n = m.weight.shape[0]
            changes[name] = alpha / rank * up[row:row + n] @ down
            row += n
    return tensors, changes


@contextlib.contextmanager
def swapped(ref, **models):
    """The diffusers pipeline with some models replaced (put back on exit)."""
    old = {name: getattr(ref, name) for name in models}
    for name, model in models.items():
        setattr(ref, name, model)
    try:
        yield ref
    finally:
        for name, model in old.items():
            setattr(ref, name, model)


def changed(model, changes: dict):
    """A copy of ``model`` with weight changes added by module name."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in model.named_modules():
            if name in changes:
                m.weight += changes[name]
    return model


def test_kohya_and_comfyui_bfl_names_match_the_formula(flux):
    ref, pipe, base, folder, _ = flux
    for what, kwargs in (("kohya", {}), ("ComfyUI", dict(prefix="diffusion_model.", dotted=True)),
                         ("fal", dict(prefix="base_model.model.", dotted=True, alpha=4.0))):
        tensors, changes = kohya_flux(ref, files.Rand(50 + len(what)), **kwargs)
        if what == "fal":  # fal's Kontext trainer: PEFT's lora_A / lora_B, no alphas (diffusers' fal converter)
            tensors = {k.replace(".lora_down.", ".lora_A.").replace(".lora_up.", ".lora_B."): v
                       for k, v in tensors.items() if not k.endswith(".alpha")}
        path = files.save(tensors, folder / f"{what}.safetensors")
        got = _fused(pipe, path)
        with swapped(ref, transformer=changed(ref.transformer, changes)):
            _close(got, _theirs(ref), f"{what} BFL names")
        _moved(got, base, what)


def test_kohya_text_encoders_match_the_formula(flux):
    ref, pipe, base, folder, _ = flux
    rand = files.Rand(55)
    clip = files.modules(files.checkpoint_named(ref.text_encoder), TEXT)
    t5 = files.modules(ref.text_encoder_2, T5)
    tensors = {**files.kohya(clip, "lora_te1_", rand, rank=4, alpha=8.0),
               **files.kohya(t5, "lora_te3_", rand, rank=2, alpha=1.0)}
    got = _fused(pipe, files.save(tensors, folder / "te.safetensors"))
    clip_changes = {n[len("text_model."):]: 8.0 / 4 * tensors[files.underscored("lora_te1_", n) + ".lora_up.weight"]
                    @ tensors[files.underscored("lora_te1_", n) + ".lora_down.weight"] for n in clip}
    t5_changes = {n: 1.0 / 2 * tensors[files.underscored("lora_te3_", n) + ".lora_up.weight"]
                  @ tensors[files.underscored("lora_te3_", n) + ".lora_down.weight"] for n in t5}
    with swapped(ref, text_encoder=changed(ref.text_encoder, clip_changes),
                 text_encoder_2=changed(ref.text_encoder_2, t5_changes)):
        _close(got, _theirs(ref), "kohya CLIP + T5")
    _moved(got, base, "kohya text encoders")


def test_xlabs_matches_diffusers(flux):
    ref, pipe, base, folder, _ = flux
    rand, tensors = files.Rand(60), {}
    modules = dict(ref.transformer.named_modules())
    layers = bfl_layers(ref)
    xlabs = {}
    for i in range(len(ref.transformer.transformer_blocks)):
        d = f"double_blocks.{i}."
        xlabs.update({d + "processor.qkv_lora1": d + "img_attn.qkv", d + "processor.qkv_lora2": d + "txt_attn.qkv",
                      d + "processor.proj_lora1": d + "img_attn.proj", d + "processor.proj_lora2": d + "txt_attn.proj"})
    for i in range(len(ref.transformer.single_transformer_blocks)):
        s = f"single_blocks.{i}."
        xlabs.update({s + "processor.qkv_lora": s + "linear1", s + "processor.proj_lora": s + "linear2"})
    for key, bfl in xlabs.items():
        parts = [modules[p] for p in layers[bfl]][:3]  # XLabs' single-block qkv_lora: the q, k, v rows of linear1
        tensors[key + ".down.weight"] = rand.down(4, parts[0])
        tensors[key + ".up.weight"] = torch.cat([rand.up(4, m) for m in parts])
    path = files.save(tensors, folder / "xlabs.safetensors")
    report = eqxdiff.lora.inspect(path, pipe)
    assert report.family == "Flux.1" and report.supported
    ref.load_lora_weights(str(path))
    try:
        ref.fuse_lora()
        expected = _theirs(ref)
    finally:
        ref.unfuse_lora()
        ref.unload_lora_weights()
    got = _fused(pipe, path)
    _close(got, expected, "XLabs")
    _moved(got, base, "XLabs")


# -- diffusers / PEFT, unfused and fused ------------------------------------------------------------------------------

def peft_flux(ref, path, rand):
    """ai-toolkit style: ``transformer.`` PEFT keys with stray ``.alpha`` keys, CLIP and T5 in PEFT names."""
    mods = files.modules(ref.transformer, LINEARS)
    tensors = files.peft(mods, "transformer.", rand, rank=4)
    tensors.update({f"transformer.{n}.alpha": torch.tensor(2.0) for n in mods})
    tensors.update(files.peft(files.modules(files.checkpoint_named(ref.text_encoder), TEXT), "text_encoder.", rand,
                              rank=2))
    t5 = files.peft(files.modules(ref.text_encoder_2, T5), "text_encoder_2.", rand, rank=2)
    files.save({**tensors, **t5}, path)
    return tensors, t5


def peft_t5(ref, t5: dict):
    """A copy of the diffusers pipeline's T5 running PEFT's own LoRA layers with ``t5`` (diffusers does not load T5
    LoRAs for Flux)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    model = copy.deepcopy(ref.text_encoder_2)
    targets = sorted({k.split(".")[-3] for k in t5})
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=targets), model)
    result = set_peft_model_state_dict(model, {k[len("text_encoder_2."):]: v for k, v in t5.items()})
    assert not [k for k in result.unexpected_keys if "lora" in k]
    return model


def test_peft_unfused_and_fused(flux):
    ref, pipe, base, folder, _ = flux
    path = folder / "peft.safetensors"
    _, t5 = peft_flux(ref, path, files.Rand(70))
    with swapped(ref, text_encoder_2=peft_t5(ref, t5)):
        ref.load_lora_weights(str(path))
        try:
            unfused_ref = _theirs(ref)
            scaled_ref = _theirs(ref, joint_attention_kwargs={"scale": 0.5})
            ref.fuse_lora(lora_scale=0.5)  # the transformer only: diffusers' Flux default, the encoders' stay unfused
            fused_ref = _theirs(ref)
        finally:
            ref.unfuse_lora()
            ref.unload_lora_weights()
    pipe.load_lora_weights(path, adapter_name="p")
    try:
        got = _ours(pipe)
        _close(got, unfused_ref, "PEFT unfused")
        _moved(got, base, "PEFT")
        with no_compile("joint_attention_kwargs scale 0.5"):  # the transformer, CLIP and T5 at half strength
            scaled = _ours(pipe, joint_attention_kwargs={"scale": 0.5})
        _close(scaled, scaled_ref, "PEFT, LoRA scale 0.5")
        _moved(scaled, got, "LoRA scale 0.5")
        pipe.set_adapters("p", 0.0)
        with no_compile("strength 0"):
            assert np.max(np.abs(_ours(pipe).astype(int) - base.astype(int))) <= 1
        pipe.set_adapters("p", 1.0)
        pipe.fuse_lora(lora_scale=0.5)  # found by the LoRA fuzz (seed 400): CLIP's adapter was fused too, at 0.5
        with no_compile("fused"):
            _close(_ours(pipe), fused_ref, "PEFT fused at 0.5")
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


# -- fused projections and scanned stacks, on the models --------------------------------------------------------------

def test_fused_projections_and_scanned_stacks_take_the_same_files(flux):
    """The transformer with ``fused_projections`` gets a double block's separate ``to_q/k/v`` adapters block diagonal
    on ``to_qkv`` and a kohya ``linear1`` whole on ``to_qkv_mlp``; a scanned CLIP takes adapters that skip a layer,
    at ranks 2 and 4. Each model equals the plain one holding the same file."""
    ref, pipe, base, folder, source = flux
    FluxPipeline = resolve_class("FluxPipeline")
    fused = eqxdiff.load(source, "transformer", config_overrides={"fused_projections": True})
    scanned = eqxdiff.load(source, "text_encoder", scan_layers=True)
    other = FluxPipeline.from_pipe(pipe, transformer=fused, text_encoder=scanned)
    rand = files.Rand(80)
    separate = files.modules(ref.transformer, r"transformer_blocks\.\d+\.attn\.(to_[qkv]|add_[qkv]_proj)$")
    tensors = files.peft({k: v for k, v in separate.items() if not k.startswith("single")}, "transformer.", rand)
    bfl, _ = kohya_flux(ref, files.Rand(81))
    tensors.update({k: v for k, v in bfl.items() if k.startswith(("lora_unet_single", "lora_unet_final"))})
    clip = files.modules(files.checkpoint_named(ref.text_encoder),
                         r"layers\.0\.self_attn\.q_proj$|layers\.1\.mlp\.fc1$")
    tensors.update(files.peft({k: v for k, v in clip.items() if "q_proj" in k}, "text_encoder.", rand, rank=2))
    tensors.update(files.peft({k: v for k, v in clip.items() if "fc1" in k}, "text_encoder.", rand, rank=4))
    path = files.save(tensors, folder / "mixed.safetensors")  # namings may mix in one file
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 20, (1, 16)), jnp.int32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 16, 4)), jnp.float32)
    txt = jnp.asarray(np.random.default_rng(2).standard_normal((1, 6, 32)), jnp.float32)
    pooled = jnp.asarray(np.random.default_rng(3).standard_normal((1, 32)), jnp.float32)
    rope = pipe.transformer.rotary_embedding(flux_model.image_ids(4, 4), flux_model.text_ids(6))

    @eqx.filter_jit
    def forward(transformer, text_encoder):
        return (transformer(x, txt, pooled, jnp.asarray([0.5]), rope=rope, guidance=jnp.asarray([3.5])),
                text_encoder(tokens).last_hidden_state)

    plain = forward(pipe.transformer, pipe.text_encoder)
    pipe.load_lora_weights(path)
    other.load_lora_weights(path)
    try:
        want, got = forward(pipe.transformer, pipe.text_encoder), forward(other.transformer, other.text_encoder)
        assert_close(got[0], want[0], what="fused projections")
        assert_close(got[1], want[1], what="scanned CLIP")
        assert not np.allclose(want[0], plain[0], atol=1e-3) and not np.allclose(want[1], plain[1], atol=1e-3)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
        other.unload_lora_weights()
