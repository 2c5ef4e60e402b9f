"""LoRA training and DreamBooth on the shared trainer (issue 19), on a digits-architecture pipeline at the tiny sizes
tests/_tiny_train.py trains (random weights, exported as the trainer exports: any model is what a LoRA starts from).
One tiny run (a style LoRA with rank 4 / alpha 8 on the attention, feed-forward and convolution layers of the UNet and
on the text encoder, from thick-stroked digits as the README's example, with prior preservation on 4 class images the
model draws itself) trains three steps with a checkpoint at step 2, and a second run resumes from that checkpoint,
reusing the class images. Its assertions:

- only the adapters train: ``state.params`` and the optimizer state hold the adapters' arrays alone (their bytes
  against a full fine-tune's, measured), and every weight of the model comes out bit-identical to the loaded ones;
- the resumed run ends exactly where the straight one does; a resume with other LoRA settings is refused;
- the saved PEFT file is what diffusers' ``load_lora_weights`` reads: diffusers' UNet and text encoder with it
  equal the trained models (<= 1e-4 of the output's scale), and so does eqxdiff's pipeline loading it, at any
  strength (0: the model itself; the adapter moved the output);
- ``--lora.format kohya`` writes kohya's layout, which eqxdiff reads back to the same models;
- the class images are drawn once into class_data_dir, kept and reused, refused when drawn with another prompt, and
  prior preservation's batch weights make the loss the instance loss plus prior_loss_weight times the class loss.

DoRA's file (PEFT's magnitude, kohya's ``dora_scale``) is checked the same way on adapters with random values (no
training: the writer is the same). SDXL's and Flux's files (SGM and Black Forest Labs' fused layouts) and their
training runs: tests/test_train_lora_families.py."""

import dataclasses
import shutil
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff import nn
from eqxdiff.data import ImageFolderSource
from eqxdiff.data.digits import caption, load_digits_arrays, upscale
from eqxdiff.loading.lora import read_lora
from eqxdiff.train import (
    CheckpointMismatchError,
    LatentDiffusion,
    LoraConfig,
    OptimizerConfig,
    TrainConfig,
    add_lora,
    lora_filter,
    make_optimizer,
    run,
    save_lora,
    trainable_filter,
)
from eqxdiff.train._dreambooth import PriorBatches, class_images
from eqxdiff.train._lora import site_kind
from eqxdiff.train._objectives import weighted_mse
from eqxdiff.train._resume import resume_point
from eqxdiff.train._setup import build, export_pipeline
from eqxdiff.train._step import LOSS_WEIGHT

from ._tiny_train import TINY
from ._util import nhwc_to_nchw

LORA = LoraConfig(rank=4, alpha=8.0, targets=("attention", "mlp", "conv"), text_encoders=True)
PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
CLASS_PROMPT = "a handwritten digit"


def thick_digits(folder, n: int | None = None, size: int = 16) -> None:
    """The README's style data: the digits at ``size`` px with strokes dilated by a pixel (a 2x2 maximum filter),
    each with its caption beside it."""
    from PIL import Image
    from scipy.ndimage import grey_dilation

    images, labels = load_digits_arrays()
    thick = grey_dilation(upscale(images[:n], size), size=(1, 2, 2, 1))
    folder.mkdir(parents=True, exist_ok=True)
    for i, (x, y) in enumerate(zip(thick, labels)):
        Image.fromarray(((x + 1) * 127.5).round().astype(np.uint8)).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(caption(y))


def _config(root, **changes) -> TrainConfig:
    settings = dict(model=str(root / "pipe"), data=str(root / "thick"), resolution=TINY.image_size, batch_size=4,
                    steps=3, lora=LORA, class_prompt=CLASS_PROMPT, class_data_dir=root / "classes",
                    num_class_images=4, prior_loss_weight=0.5, sample_steps=2,
                    optimizer=OptimizerConfig(learning_rate=3e-2, schedule="constant", total_steps=3),
                    random_flip=False, checkpoint_every=2, log_every=1, progress=False, export_scheduler=None)
    return TrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding the tiny digits-architecture pipeline (``pipe``) and 16 thick digits at its 8 px
    (``thick``)."""
    root = tmp_path_factory.mktemp("lora_train")
    setup = build(TrainConfig(architecture=TINY, resolution=TINY.image_size))
    export_pipeline(setup.model, setup.tokenizers, setup.noise_scheduler, root / "pipe", scheduler=None)
    thick_digits(root / "thick", 16, TINY.image_size)
    return root


@pytest.fixture(scope="module")
def runs(root):
    """Three steps straight (a checkpoint at step 2; the class images drawn first), then a run resuming from a copy
    of that checkpoint (the same compiled step, the same class images); the class images' modification times after
    the first run."""
    straight = run(_config(root, output_dir=root / "a"))
    drawn = {p.name: p.stat().st_mtime_ns for p in (root / "classes").iterdir()}
    (root / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "a" / "checkpoints" / "2", root / "b" / "checkpoints" / "2")
    resumed = run(_config(root, output_dir=root / "b"))
    return root, straight, resumed, drawn


@pytest.fixture(scope="module")
def base(root):
    """The tiny pipeline as loaded, and its training bundle."""
    pipe = eqxdiff.load_pipeline(root / "pipe")
    return pipe, LatentDiffusion.from_pipeline(pipe)[0]


def _inputs(pipe):
    rng = np.random.default_rng(0)
    tok = pipe.tokenizer
    ids = tok(PROMPTS, padding="max_length", max_length=tok.model_max_length, return_tensors="np").input_ids
    x = rng.standard_normal((2, 4, 4, 4)).astype(np.float32)
    return x, np.asarray([100, 700]), ids.astype(np.int32)


@eqx.filter_jit
def _forward(unet, text_encoder, x, t, ids):
    """The UNet's output on the text encoder's states of ``ids``, and those states."""
    states = text_encoder(ids).last_hidden_state
    return unet(x, t, states), states


def _ours(unet, text_encoder, inputs):
    out, states = _forward(unet, text_encoder, *(jnp.asarray(a) for a in inputs))
    return np.asarray(out), np.asarray(states)


def _close(actual, expected, what: str, tol: float = 1e-4) -> None:
    err = float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), 1e-6)
    assert err <= tol, f"{what}: {err:.2e} of the output's scale"


def test_only_the_adapters_train_and_the_weights_stay_bit_identical(runs, base):
    _, (state, frozen, losses), _, _ = runs
    _, loaded = base
    assert int(state.step) == 3 and len(losses) == 3 and all(np.isfinite(losses))
    trained = state.model(frozen)
    # every trainable leaf is an adapter's (LoRA factors), and the optimizer state is theirs alone
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    assert paths and all(".adapters.entries[0]." in p for p in paths), paths[:3]
    assert {p.split(".")[1] for p in paths} == {"unet", "text_encoder"}
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if jnp.ndim(x) > 0)
    full = eqx.filter(eqx.partition(loaded, trainable_filter(loaded))[0], eqx.is_array)
    full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(make_optimizer(
        OptimizerConfig(total_steps=3)).init, full)) if x.ndim > 0)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # rank x (fan in + fan out) float32 numbers for every targeted layer of the UNet and the text encoder
    sites = [s for name in ("unet", "text_encoder") for s in nn.adapter_sites(getattr(loaded, name))
             if site_kind(s) in LORA.targets]
    expected = sum(4 * LORA.rank * (int(np.prod(s.shape[1:])) + s.shape[0]) * (s.layers or 1) for s in sites)
    assert adapter_bytes == expected, (adapter_bytes, expected)
    assert opt_bytes == 2 * adapter_bytes  # Adam's two moments of the adapters, nothing else
    assert full_bytes == 2 * sum(x.nbytes for x in jax.tree.leaves(full))  # a full fine-tune's: the whole UNet's
    # the model's own weights: bit for bit the loaded ones
    strip = lambda m: nn.map_adapters(m, lambda site, a: None)
    for name in ("unet", "text_encoder", "vae"):
        a, b = jax.tree.leaves(strip(getattr(trained, name))), jax.tree.leaves(getattr(loaded, name))
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), name
    moved = [float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(eqx.filter(state.params, eqx.is_array))]
    assert min(moved) > 0  # up left zero, down moved: every adapter trained


def test_resume_is_exact_and_other_lora_settings_are_refused(runs):
    root, (state, _, losses), (resumed, _, resumed_losses), _ = runs
    assert int(resumed.step) == 3 and len(resumed_losses) == 1 and resumed_losses[0] == losses[-1]
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, b)
    for change in (dict(rank=8), dict(alpha=4.0), dict(targets=("attention",)), dict(dora=True),
                   dict(text_encoders=False)):
        lora = dataclasses.replace(LORA, **change)
        key = f"lora.{next(iter(change))}"
        with pytest.raises(CheckpointMismatchError, match=rf"cannot resume .*trained with other settings: {key}="):
            resume_point(_config(root, output_dir=root / "b", lora=lora, steps=4))
    point = resume_point(_config(root, output_dir=root / "b", lora=dataclasses.replace(LORA, format="kohya"), steps=4))
    assert point.changes == {"lora.format": ("peft", "kohya"), "steps": (3, 4)}  # what is written, not trained


def test_the_peft_file_loads_in_diffusers_and_in_eqxdiff(runs, base):
    root, (state, frozen, _), _, _ = runs
    pipe, loaded = base
    trained = state.model(frozen)
    file = root / "a" / "lora" / "pytorch_lora_weights.safetensors"
    assert sorted(p.name for p in file.parent.iterdir()) == [file.name]
    meta = read_lora(file).peft_config()
    assert meta["unet.r"] == 4 and meta["unet.lora_alpha"] == 8.0 and meta["text_encoder.lora_alpha"] == 8.0
    inputs = _inputs(pipe)
    expected, states = _ours(trained.unet, trained.text_encoder, inputs)
    plain, plain_states = _ours(loaded.unet, loaded.text_encoder, inputs)
    assert np.max(np.abs(expected - plain)) > 1e-2 and np.max(np.abs(states - plain_states)) > 1e-2  # it moved

    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(root / "pipe", safety_checker=None)
    ref.load_lora_weights(str(file))
    x, t, ids = inputs
    with torch.no_grad():
        their_states = ref.text_encoder(torch.from_numpy(ids).long())[0]
        theirs = ref.unet(nhwc_to_nchw(x), torch.from_numpy(t), their_states).sample
    _close(their_states.numpy(), states, "diffusers' text encoder with the file")
    _close(theirs.permute(0, 2, 3, 1).numpy(), expected, "diffusers' UNet with the file")

    pipe.load_lora_weights(file, adapter_name="thick")
    try:
        got, got_states = _ours(pipe.unet, pipe.text_encoder, inputs)
        _close(got, expected, "eqxdiff's UNet with the file")
        _close(got_states, states, "eqxdiff's text encoder with the file")
        pipe.set_adapters("thick", [0.0])
        off, _ = _ours(pipe.unet, pipe.text_encoder, inputs)
        np.testing.assert_allclose(off, plain, atol=1e-6)
    finally:
        pipe.unload_lora_weights()


def test_kohya_layout_reads_back(runs, base):
    root, (state, frozen, _), _, _ = runs
    pipe, loaded = base
    trained = state.model(frozen)
    file = save_lora(trained, dataclasses.replace(LORA, format="kohya"), root / "kohya" / "lora.safetensors")
    keys = set(read_lora(file).tensors)
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in keys
    assert "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight" in keys
    inputs = _inputs(pipe)
    expected, states = _ours(trained.unet, trained.text_encoder, inputs)
    pipe.load_lora_weights(file)
    try:
        got, got_states = _ours(pipe.unet, pipe.text_encoder, inputs)
    finally:
        pipe.unload_lora_weights()
    _close(got, expected, "kohya file read back (UNet)", 1e-5)
    _close(got_states, states, "kohya file read back (text encoder)", 1e-5)


def test_dora_files_load_in_diffusers_and_read_back(root, base, tmp_path):
    """DoRA adapters (random values, a magnitude moved off the weights' norms) on the UNet's attention and
    convolutions and the text encoder: diffusers reads the PEFT file to the same models, eqxdiff reads the PEFT
    and the kohya (``dora_scale``) files back."""
    pipe, loaded = base
    config = LoraConfig(rank=2, alpha=3.0, targets=("attention", "conv"), dora=True, text_encoders=True)
    bundle = add_lora(loaded, config, seed=1)
    spec = lora_filter(bundle)
    rng = np.random.default_rng(2)

    def randomise(path, leaf, trainable):
        if not trainable:
            return leaf
        name = getattr(path[-1], "name", "")
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        return jnp.asarray(leaf * (1 + 0.2 * noise) if name == "magnitude" else 0.3 * noise)

    bundle = jax.tree_util.tree_map_with_path(randomise, bundle, spec)
    assert sum(getattr(p[-1], "name", "") == "magnitude" and t
               for p, t in jax.tree_util.tree_flatten_with_path(spec)[0]) > 0  # DoRA's magnitudes train
    inputs = _inputs(pipe)
    expected, states = _ours(bundle.unet, bundle.text_encoder, inputs)
    peft = save_lora(bundle, config, tmp_path / "dora" / "pytorch_lora_weights.safetensors")
    kohya = save_lora(bundle, dataclasses.replace(config, format="kohya"), tmp_path / "dora_kohya.safetensors")

    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(root / "pipe", safety_checker=None)
    ref.load_lora_weights(str(peft))
    x, t, ids = inputs
    with torch.no_grad():
        their_states = ref.text_encoder(torch.from_numpy(ids).long())[0]
        theirs = ref.unet(nhwc_to_nchw(x), torch.from_numpy(t), their_states).sample
    _close(their_states.numpy(), states, "diffusers' text encoder with the DoRA file")
    _close(theirs.permute(0, 2, 3, 1).numpy(), expected, "diffusers' UNet with the DoRA file")
    for file in (peft, kohya):
        pipe.load_lora_weights(file)
        try:
            got, got_states = _ours(pipe.unet, pipe.text_encoder, inputs)
        finally:
            pipe.unload_lora_weights()
        _close(got, expected, f"{file} read back (UNet)")
        _close(got_states, states, f"{file} read back (text encoder)")


def test_lora_settings_errors():
    for kwargs, match in ((dict(rank=-1), r"lora.rank=-1 must be >= 0"), (dict(alpha=0.0), r"lora.alpha=0.0 must be"),
                          (dict(targets=()), r"lora.targets is empty"),
                          (dict(targets=("attn",)), r"lora.targets='attn'; choose one of \['attention', 'mlp'"),
                          (dict(format="ckpt"), r"lora.format='ckpt'; choose one of \['peft', 'kohya'\]")):
        with pytest.raises(ValueError, match=match):
            LoraConfig(**kwargs)
    with pytest.raises(ValueError, match=r"lora.rank=4 needs a pretrained model: give model="):
        TrainConfig(lora=LoraConfig(rank=4))
    with pytest.raises(ValueError, match=r"train_text_encoder=True trains the text encoders' weights in full"):
        TrainConfig(model="digits", data="synthetic", train_text_encoder=True,
                    lora=LoraConfig(rank=4, text_encoders=True))


def test_prior_preservation_draws_the_class_images_once_and_weights_the_loss(runs, base):
    root, _, _, drawn = runs
    _, loaded = base
    from PIL import Image

    classes = root / "classes"
    names = sorted(p.name for p in classes.iterdir())
    assert names == ["class_00000.png", "class_00001.png", "class_00002.png", "class_00003.png", "class_images.json"]
    images = [np.asarray(Image.open(classes / n)) for n in names[:4]]
    assert all(x.shape == (TINY.image_size, TINY.image_size, 3) for x in images)
    assert np.ptp(np.stack(images)) > 0  # drawn by the model, not blank
    # the resumed run reused them: nothing redrawn, nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in classes.iterdir()} == drawn
    setup = types.SimpleNamespace(model=loaded)
    with pytest.raises(ValueError, match=r"the class images in .* were drawn with other settings: class_prompt="):
        class_images(_config(root, class_prompt="a handwritten letter"), setup)
    # the batch: the data's rows then the class rows; the weighted mean is instance + prior_loss_weight x class
    rng = np.random.default_rng(0)
    a, b = ({"x": rng.standard_normal((3, 2)).astype(np.float32)} for _ in range(2))
    batch = next(PriorBatches(iter([a]), iter([b]), 0.5))
    np.testing.assert_array_equal(batch["x"], np.concatenate([a["x"], b["x"]]))
    goal = np.zeros_like(batch["x"])
    loss = float(weighted_mse(jnp.asarray(batch["x"]), goal, jnp.asarray(batch[LOSS_WEIGHT])))
    expected = float(np.mean(a["x"] ** 2) + 0.5 * np.mean(b["x"] ** 2))
    assert abs(loss - expected) <= 1e-6 * expected


def test_dreambooth_instance_prompt_and_errors(root):
    source = ImageFolderSource(root / "thick", caption="a photo of sks digit")
    assert len(source) == 16 and {source[i]["caption"] for i in range(16)} == {"a photo of sks digit"}
    assert _config(root, instance_prompt="a photo of sks digit").instance_prompt == "a photo of sks digit"
    with pytest.raises(ValueError, match=r"class_data_dir='.*' holds prior preservation's class images; give "
                       r"class_prompt too"):
        _config(root, class_prompt=None)
    with pytest.raises(ValueError, match=r"instance_prompt=' ' is empty; give a prompt"):
        _config(root, instance_prompt=" ")
    with pytest.raises(ValueError, match=r"prior_loss_weight=-1.0 must be a finite number >= 0"):
        _config(root, prior_loss_weight=-1.0)
    with pytest.raises(ValueError, match=r"instance_prompt captions the images of an image source; data='digits'"):
        _config(root, data="digits", instance_prompt="a photo of sks digit")
