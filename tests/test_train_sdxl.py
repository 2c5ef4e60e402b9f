"""SDXL fine-tuning on the shared train stack (issue 11): ``train.run`` on a tiny SDXL pipeline folder built with
diffusers, both text encoders frozen and cached, the micro-conditioning from each image's original size and crop,
on an FSDP mesh of the 8 simulated devices with full remat; exact resume; the export loaded by diffusers'
``StableDiffusionXLPipeline``. The pieces against diffusers: the cached prompt embeddings (``encode_prompt``) and
VAE posterior, and the train step's UNet call with its time ids. One compiled step program serves both runs."""

import dataclasses
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff.core import leaf_specs
from eqxdiff.data import DataError, ImageCaptionTransform, ImageFolderSource, character_tokenizer
from eqxdiff.data._transforms import resize_to_cover, to_unit_range
from eqxdiff.parallel import MeshConfig, Remat
from eqxdiff.train import (
    Objective,
    OptimizerConfig,
    SDXLLatentDiffusion,
    TrainConfig,
    build,
    check_batch,
    run,
    train_family,
)
from eqxdiff.train._sources import open_source

from . import _tiny_sdxl
from ._util import rel_error

# A one-level SDXL UNet (text_time embedding of 6 time ids x 4 + the pooled 24; cross-attention over the two
# encoders' 32 + 48 channels): its train step compiles in seconds on the mesh. Two channels per group norm: with one
# (8 groups of 8 channels) the norm after each ResNet's time-embedding add takes the added constant away again, so
# the time ids (and the timestep) could not change the output.
UNET = dict(block_out_channels=(8,), norm_num_groups=4, layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",), attention_head_dim=2,
            use_linear_projection=True, addition_time_embed_dim=4, transformer_layers_per_block=1,
            cross_attention_dim=80, projection_class_embeddings_input_dim=6 * 4 + _tiny_sdxl.POOLED)
RESOLUTION = 16
SIZES = [(20, 28), (24, 16), (16, 16), (32, 20), (18, 30), (40, 24), (16, 22), (26, 26)]  # (height, width)
FSDP = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny SDXL pipeline (diffusers, every weight random) saved to a folder, and 8 captioned images of
    different sizes and aspect ratios."""
    from diffusers import StableDiffusionXLPipeline
    from PIL import Image

    root = tmp_path_factory.mktemp("sdxl_train")
    components = _tiny_sdxl.base_components()
    components["unet"] = _tiny_sdxl.unet(UNET, seed=4)
    pipe = _tiny_sdxl.save(StableDiffusionXLPipeline(**components, add_watermarker=False), root / "pipe")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a {'red green blue black white pink gold grey'.split()[i]} thing")
    return root, pipe


def _config(root, **changes) -> TrainConfig:
    settings = dict(model=str(root / "pipe"), data=str(root / "images"), resolution=RESOLUTION, batch_size=8,
                    steps=3, mesh=FSDP, remat=Remat.FULL, cache_stream=True, center_crop=False, export_scheduler=None,
                    log_every=1, progress=False,
                    optimizer=OptimizerConfig(learning_rate=1e-3, total_steps=3, schedule="constant"),
                    objective=Objective(caption_dropout=0.25))
    return TrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def runs(folders):
    """Three steps straight (a checkpoint at step 2), then a second run from a copy of that checkpoint and of the
    cache, resuming at step 2 (the same compiled step program)."""
    root, _ = folders
    straight = run(_config(root, output_dir=root / "a", checkpoint_every=2))
    (root / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "a" / "checkpoints" / "2", root / "b" / "checkpoints" / "2")
    shutil.copytree(root / "a" / "cache", root / "b" / "cache")
    shutil.copy(root / "a" / "config.json", root / "b" / "config.json")
    resumed = run(_config(root, output_dir=root / "b", checkpoint_every=2))
    return straight, resumed


def test_micro_conditioning_records_the_size_and_the_crop_of_the_pixels():
    """The facts the SDXL bundle asks the data for (``IMAGE_KEYS``): ``original_size`` is the decoded image's;
    ``crop_top_left`` is where the output pixels sit in the resized image (in the flipped image when flipped, as
    diffusers' script flips before cropping), for random and center crops of tall and wide images; each tokenizer
    fills its key."""
    tok, tok_2 = character_tokenizer(16), character_tokenizer(12)
    y, x = np.mgrid[:40, :60]
    picture = np.stack([(3 * y + 7 * x) % 256, (11 * y + 2 * x) % 256, (5 * x * y) % 256], -1).astype(np.uint8)
    for image in (picture[:30, :20], picture[:20, :30]):
        resized = resize_to_cover(image, RESOLUTION, RESOLUTION)
        for center_crop in (True, False):
            transform = ImageCaptionTransform({"input_ids": tok, "input_ids_2": tok_2}, RESOLUTION,
                                              center_crop=center_crop,
                                              image_keys=SDXLLatentDiffusion.IMAGE_KEYS)
            seen = set()
            for seed in range(12):
                out = transform({"image": image, "caption": "a cat", "name": "x"}, np.random.default_rng(seed))
                assert out["original_size"].tolist() == list(image.shape[:2])
                top, left = out["crop_top_left"].tolist()
                matches = [flipped for flipped, frame in ((False, resized), (True, resized[:, ::-1]))
                           if np.array_equal(out["pixel_values"],
                                             to_unit_range(frame[top:top + RESOLUTION, left:left + RESOLUTION]))]
                assert len(matches) == 1, (center_crop, seed, top, left)
                seen.add((matches[0], top, left))
                assert out["input_ids"].shape == (16,) and out["input_ids_2"].shape == (12,)
            assert {flipped for flipped, _, _ in seen} == {False, True}
            corners = {(t, le) for _, t, le in seen}
            h, w = resized.shape[:2]
            if center_crop:
                assert corners == {((h - RESOLUTION) // 2, (w - RESOLUTION) // 2)}
            else:
                assert len(corners) > 2  # the crops moved


def test_cache_holds_what_diffusers_encodes(folders, runs):
    """The cached text embeddings are diffusers' ``encode_prompt`` of each caption (both encoders' penultimate
    states, the pooled projection of the second), the cached posterior is diffusers' VAE's on the same pixels, and
    the micro-conditioning rows are each image's size and the crop the one pass drew."""
    root, pipe = folders
    cache = {k: np.load(root / "a" / "cache" / f"{k}.npy") for k in SDXLLatentDiffusion.batch_keys(cached=True)}
    source = ImageFolderSource(root / "images")
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(source.captions, do_classifier_free_guidance=False)
    assert rel_error(cache["encoder_hidden_states"], embeds.numpy()) <= 1e-4
    assert rel_error(cache["text_embeds"], pooled.numpy()) <= 1e-4
    setup = build(_config(root, mesh=None))
    (batch,) = list(setup.stream(_config(root), source, shuffle=False, num_epochs=1, drop_remainder=False))
    assert sorted(batch) == sorted(SDXLLatentDiffusion.batch_keys(cached=False))  # what the bundle asks for
    with torch.no_grad():
        dist = pipe.vae.encode(torch.from_numpy(np.moveaxis(batch["pixel_values"], -1, 1))).latent_dist
    assert rel_error(cache["latent_mean"], np.moveaxis(dist.mean.numpy(), 1, -1)) <= 1e-4
    assert rel_error(cache["latent_std"], np.moveaxis(dist.std.numpy(), 1, -1)) <= 1e-4
    from PIL import Image

    sizes = [Image.open(p).size[::-1] for p in source.paths]
    np.testing.assert_array_equal(cache["original_size"], sizes)
    np.testing.assert_array_equal(cache["crop_top_left"], batch["crop_top_left"])
    assert np.any(cache["crop_top_left"] > 0)  # random crops of non-square images moved


def test_train_step_calls_the_unet_as_diffusers_script(folders, runs):
    """The bundle's denoiser call equals diffusers' UNet with ``added_cond_kwargs`` ``text_embeds`` and
    ``time_ids = original_size + crop_top_left + (resolution, resolution)``, at two timesteps and crops."""
    root, pipe = folders
    model = build(_config(root, mesh=None)).model
    cache = {k: np.load(root / "a" / "cache" / f"{k}.npy")[[1, 5]] for k in SDXLLatentDiffusion.batch_keys(True)}
    x = np.random.default_rng(1).standard_normal((2, 8, 8, 4)).astype(np.float32)
    t = np.asarray([10, 700], np.int32)
    cond = {k: jnp.asarray(cache[k]) for k in ("encoder_hidden_states", "text_embeds", "original_size",
                                                "crop_top_left")}
    denoise = eqx.filter_jit(lambda m, x, t, c: m.denoise(x, t, c))
    ours = denoise(model, jnp.asarray(x), jnp.asarray(t), cond)
    time_ids = np.concatenate([cache["original_size"], cache["crop_top_left"], np.full((2, 2), RESOLUTION)], -1)
    with torch.no_grad():
        want = pipe.unet(torch.from_numpy(np.moveaxis(x, -1, 1)), torch.from_numpy(t),
                         torch.from_numpy(cache["encoder_hidden_states"]),
                         added_cond_kwargs={"text_embeds": torch.from_numpy(cache["text_embeds"]),
                                            "time_ids": torch.from_numpy(time_ids.astype(np.float32))}).sample
    assert rel_error(ours, np.moveaxis(want.numpy(), 1, -1)) <= 1e-4
    # the time ids count: another crop and original size move the output (so a wrong time id fails the match above)
    moved = {**cond, "crop_top_left": cond["crop_top_left"] + 4, "original_size": cond["original_size"] * 2}
    other = denoise(model, jnp.asarray(x), jnp.asarray(t), moved)
    assert rel_error(other, ours) > 1e-3


def _leaves(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def test_sdxl_trains_on_the_fsdp_mesh_and_resumes_exactly(runs):
    """The run trains the UNet (sharded over fsdp, remat at its blocks, text encoders off the devices) and the
    resumed run continues it exactly: the same loss at step 3 and the same state, array for array."""
    (state, frozen, losses), (resumed, _, resumed_losses) = runs
    assert len(losses) == 3 and all(np.isfinite(losses)) and int(state.step) == 3
    assert resumed_losses == losses[2:] and int(resumed.step) == 3
    for a, b in zip(_leaves(resumed), _leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    params = jax.tree.leaves(state.params)
    assert params and all(len(x.sharding.device_set) == 8 for x in params)
    assert any(not x.sharding.is_fully_replicated for x in params)
    assert frozen.text_encoder is None and frozen.text_encoder_2 is None and frozen.null_embeds is not None
    assert frozen.unet.plan.remat is Remat.FULL


def test_export_loads_in_diffusers(folders, runs):
    """diffusers' ``StableDiffusionXLPipeline`` loads the exported folder: its UNet holds the trained weights
    (every tensor, in PyTorch's layout), the frozen encoders and VAE are the original ones, the scheduler is the
    folder's; and it generates."""
    from diffusers import StableDiffusionXLPipeline

    root, pipe = folders
    (state, frozen, _), _ = runs
    exported = StableDiffusionXLPipeline.from_pretrained(root / "a" / "pipeline")
    trained = state.model(frozen).unet
    leaves, specs, _ = leaf_specs(trained)
    unet, original = exported.unet.state_dict(), pipe.unet.state_dict()
    assert sorted(s.name for s in specs) == sorted(unet)
    changed = 0
    for leaf, spec in zip(leaves, specs):
        ours = np.asarray(leaf)
        if spec.perm is not None:
            ours = np.transpose(ours, np.argsort(spec.perm))
        np.testing.assert_array_equal(unet[spec.name].numpy(), ours, err_msg=spec.name)
        changed += not np.array_equal(ours, original[spec.name].numpy())
    assert changed > len(specs) // 2
    for name in ("text_encoder", "text_encoder_2", "vae"):
        got, want = getattr(exported, name).state_dict(), getattr(pipe, name).state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), name
    assert type(exported.scheduler) is type(pipe.scheduler)
    got, want = ({k: v for k, v in json.loads((folder / "scheduler" / "scheduler_config.json").read_text()).items()
                  if not k.startswith("_")} for folder in (root / "a" / "pipeline", root / "pipe"))
    assert got == want
    exported.set_progress_bar_config(disable=True)
    images = exported("a red thing", num_inference_steps=2, height=RESOLUTION, width=RESOLUTION, output_type="np",
                      generator=torch.manual_seed(0)).images
    assert images.shape == (1, RESOLUTION, RESOLUTION, 3) and np.all(np.isfinite(images))


def test_sdxl_errors(folders):
    """What a user can get wrong: the digits set for a two-encoder model, a batch without micro-conditioning, a
    pipeline eqxdiff does not fine-tune, a refiner."""
    import types

    root, pipe = folders
    tokenizers = {"input_ids": pipe.tokenizer, "input_ids_2": pipe.tokenizer_2}
    with pytest.raises(DataError, match=r"data='digits'.*needs \['input_ids', 'input_ids_2'\]"):
        open_source(dataclasses.replace(_config(root), data="digits"), tokenizers)
    batch = {"pixel_values": np.zeros((2, 16, 16, 3), np.float32), "input_ids": np.zeros((2, 4), np.int32),
             "input_ids_2": np.zeros((2, 4), np.int32)}
    with pytest.raises(DataError, match=r"lacks \['original_size', 'crop_top_left'\]"):
        check_batch(batch, model=SDXLLatentDiffusion)
    with pytest.raises(DataError, match=r"crop_top_left must be \[batch, 2\]"):
        check_batch({**batch, "original_size": np.zeros((2, 2)), "crop_top_left": np.zeros((2, 3))},
                    model=SDXLLatentDiffusion)
    with pytest.raises(ValueError, match=r"does not fine-tune a StableDiffusionXLInpaintPipeline; it trains \["):
        train_family("StableDiffusionXLInpaintPipeline")
    with pytest.raises(ValueError, match="an SDXL refiner"):
        SDXLLatentDiffusion.from_pipeline(types.SimpleNamespace(text_encoder=None))
