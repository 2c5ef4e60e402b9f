"""LoRA files of SDXL and Flux as LoRA training writes them (issue 19): adapters put by ``add_lora`` on the attention,
feed-forward and convolution layers of the denoiser and on the trainable text encoders (SDXL's two CLIPs, Flux's
CLIP), every array random (no training: the step is the one tests/test_train_lora.py runs; what differs per family is
how the file names the layers), saved as PEFT and as kohya's layout: SDXL's UNet in SGM names
(``lora_unet_input_blocks_4_1_...``), Flux's transformer in Black Forest Labs' names, where one LoRA spans the fused
``qkv`` / ``linear1`` rows of several layers (downs stacked, ups block diagonal). Each file, loaded into the family's
pipeline, gives the training bundle's output: the denoiser on the text encoders' conditioning of a prompt, through
the bundle's own ``condition`` and ``denoise`` (<= 1e-4 of the output's scale), and it moved the output. Then a
two-step LoRA training run per family (``slow``): only the adapters train, and diffusers and eqxdiff read its file."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff.loading import state_dict, without_adapters
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


def _images(folder, size: int, n: int = 4) -> None:
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(2)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a {'red green blue gold'.split()[i]} fox")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_training_run_writes_what_diffusers_reads(family, tmp_path):
    """``train.run`` with ``lora=`` on the family's tiny folder, two steps: only the adapters changed (every weight
    of the loaded models bit-identical), they moved the output, and the PEFT file it wrote loads in diffusers'
    pipeline's denoiser with every key used (no unexpected / missing keys notice) and in eqxdiff's, where it gives the
    trained bundle's output (<= 1e-4)."""
    import logging

    import diffusers

    from eqxdiff.train import FluxOptions, OptimizerConfig, TrainConfig, run

    build, bundle_class, size, _ = FAMILIES[family]
    build(tmp_path / "pipe")
    _images(tmp_path / "images", size)
    lora = dataclasses.replace(LORA, text_encoders=False, targets=("attention",))
    config = TrainConfig(model=str(tmp_path / "pipe"), data=str(tmp_path / "images"), resolution=size, batch_size=2,
                         steps=2, lora=lora, output_dir=tmp_path / "run", random_flip=False, log_every=1,
                         progress=False, export_scheduler=None, sample_every=0,
                         optimizer=OptimizerConfig(learning_rate=3e-2, schedule="constant", total_steps=2),
                         **({"family": FluxOptions(max_sequence_length=24)} if family == "flux" else {}))
    state, frozen, _ = run(config)
    trained = state.model(frozen)
    pipe = eqxdiff.load_pipeline(tmp_path / "pipe")
    base = bundle_class.from_pipeline(pipe)[0]
    denoiser, held = without_adapters(getattr(trained, trained.DENOISER))
    assert held > 0
    ours, loaded = state_dict(denoiser), state_dict(getattr(base, base.DENOISER))
    assert ours.keys() == loaded.keys() and all(np.array_equal(ours[k], loaded[k]) for k in ours)
    inputs = _inputs(base, size)
    expected = np.asarray(_output(trained, *inputs))
    assert np.max(np.abs(expected - np.asarray(_output(base, *inputs)))) > 1e-3 * np.max(np.abs(expected))
    file = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    pipe.load_lora_weights(file, adapter_name="trained")  # strict: every key adapts a layer
    _close(np.asarray(_output(bundle_class.from_pipeline(pipe)[0], *inputs)), expected, f"{family}: the file")

    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        ref = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "pipe")
        ref.load_lora_weights(str(file), adapter_name="trained")
    finally:
        logger.removeHandler(handler)
    assert ref.get_active_adapters() == ["trained"] and "trained" in getattr(ref, base.DENOISER).peft_config
    assert not [n for n in notices if "unexpected keys" in n or "missing keys" in n], notices
