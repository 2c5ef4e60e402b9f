"""LoRA files of SDXL and Flux as LoRA training writes them (issue 19): adapters put by ``add_lora`` on the attention,
feed-forward and convolution layers of the denoiser and on the trainable text encoders (SDXL's two CLIPs, Flux's
CLIP), every array random (no training: the step is the one tests/test_train_lora.py runs; what differs per family is
how the file names the layers), saved as PEFT and as kohya's layout: SDXL's UNet in SGM names
(``lora_unet_input_blocks_4_1_...``), Flux's transformer in Black Forest Labs' names, where one LoRA spans the fused
``qkv`` / ``linear1`` rows of several layers (downs stacked, ups block diagonal). Each file, loaded into the family's
pipeline, gives the training bundle's output: the denoiser on the text encoders' conditioning of a prompt, through
the bundle's own ``condition`` and ``denoise`` (<= 1e-4 of the output's scale), and it moved the output."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff.loading.lora import read_lora
from eqxdiff.train import FluxFlowMatching, LoraConfig, SDXLLatentDiffusion, add_lora, lora_filter, save_lora

from . import _tiny_flux_pipeline, _tiny_sdxl

LORA = LoraConfig(rank=2, alpha=3.0, targets=("attention", "mlp", "conv"), text_encoders=True)
# family: (how the tiny folder is built, the bundle, the pixel size, a kohya key the file must hold)
FAMILIES = {
    "sdxl": (_tiny_sdxl.build_base, SDXLLatentDiffusion, 16,
             "lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"),
    "flux": (lambda folder: _tiny_flux_pipeline.build(folder, "dev"), FluxFlowMatching, 8,
             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"),
}

PREFIXES = {("sdxl", "peft"): {"unet", "text_encoder", "text_encoder_2"}, ("sdxl", "kohya"): {"unet", "te1", "te2"},
            ("flux", "peft"): {"transformer", "text_encoder"}, ("flux", "kohya"): {"unet", "te1"}}


@eqx.filter_jit
def _output(bundle, batch, x, t):
    """The denoiser's output at ``x``, ``t`` on the conditioning of ``batch``'s token ids (and image keys)."""
    return bundle.denoise(x, t, bundle.condition(batch, jax.random.key(0), 0.0))


def _inputs(bundle, size: int):
    """A batch of a ``size`` px image (black: only its shape is read) captioned with the empty prompt (what every
    text encoder reads) with its image keys, random latents of its shape, a timestep."""
    batch = {"pixel_values": jnp.zeros((1, size, size, 3)), **{k: v[None] for k, v in bundle.null_ids().items()},
             **{k: jnp.asarray([[size, size]] if k == "original_size" else [[0, 0]]) for k in bundle.IMAGE_KEYS}}
    shape = jax.eval_shape(lambda: bundle.latents(batch, jax.random.key(0))).shape
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    return batch, x, jnp.asarray([500])


def _close(actual, expected, what: str, tol: float = 1e-4) -> None:
    err = float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), 1e-6)
    assert err <= tol, f"{what}: {err:.2e} of the output's scale"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_and_kohya_files_of_a_trained_lora_load_to_the_same_model(family, tmp_path):
    build, bundle_class, size, kohya_key = FAMILIES[family]
    build(tmp_path / "pipe")
    pipe = eqxdiff.load_pipeline(tmp_path / "pipe")
    base = bundle_class.from_pipeline(pipe)[0]
    rng = np.random.default_rng(1)
    adapted = add_lora(base, LORA, seed=0)
    adapted = jax.tree.map(lambda leaf, trains: jnp.asarray(0.3 * rng.standard_normal(leaf.shape), leaf.dtype)
                           if trains else leaf, adapted, lora_filter(adapted))
    inputs = _inputs(base, size)
    expected = np.asarray(_output(adapted, *inputs))
    plain = np.asarray(_output(base, *inputs))
    assert np.max(np.abs(expected - plain)) > 1e-2 * np.max(np.abs(plain))  # the adapters move the output
    for fmt in ("peft", "kohya"):
        file = save_lora(adapted, dataclasses.replace(LORA, format=fmt), tmp_path / f"{fmt}.safetensors")
        keys = set(read_lora(file).tensors)
        prefixes = {k.split(".")[0] if fmt == "peft" else k.split("_")[1] for k in keys}
        assert prefixes == PREFIXES[family, fmt], prefixes
        if fmt == "kohya":
            assert kohya_key in keys, sorted(keys)[:5]
        pipe.load_lora_weights(file, adapter_name=fmt)  # strict: every key adapts a layer
        try:
            loaded = bundle_class.from_pipeline(pipe)[0]
            _close(np.asarray(_output(loaded, *inputs)), expected, f"{family}: the {fmt} file loaded")
        finally:
            pipe.delete_adapters(fmt)
