"""Wan training on the shared train stack (issue 20, Training): the video folder reader (clips written by the MP4
writer and as a GIF: frames, stride, count, start; missing, corrupt and short clips; a Hugging Face dataset of clips
read as the folder), then ``train.run`` on a tiny Wan 2.2 A14B-style folder (two experts, boundary 0.875:
tests/_tiny_wan.py) from a folder of one repeated clip, latents and UMT5 embeddings cached, both experts trained on
an FSDP 4 x context 2 mesh of the 8 simulated devices (a batch of 4 videos: half a video per device) with full remat:
the cached embeddings are diffusers' ``encode_prompt``, the loss falls, a resumed run continues exactly, and
diffusers' ``WanPipeline`` loads the export, whose experts equal ours on the same inputs. One compiled step program
serves both runs. Wan 2.2 TI2V's first-frame-conditioned samples (a tiny TI2V folder, a stand-in transformer)."""

import dataclasses
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image

import eqxdiff
from eqxdiff.cli import train as train_cli
from eqxdiff.data import (
    DataError,
    FrameSampling,
    HFDatasetSource,
    HFVideoDatasetSource,
    VideoFolderSource,
    character_tokenizer,
    holds_videos,
    make_dataset,
    read_frames,
)
from eqxdiff.parallel import MeshConfig, Remat
from eqxdiff.pipelines import InputError, write_video
from eqxdiff.train import (
    Objective,
    OptimizerConfig,
    TrainConfig,
    WanFlowMatching,
    WanOptions,
    batch_loss,
    build,
    export_pipeline,
    flow_timesteps,
    run,
)
from eqxdiff.train._sources import open_source
from eqxdiff.train._wan import ExpertTimesteps

from . import _tiny_wan as tiny
from ._util import assert_close

LEVELS = np.arange(12) * 20 + 10  # frame i of the test clip is a flat grey at LEVELS[i]
FRAMES = FrameSampling(count=9, stride=1, start=2)  # 9 frames: 3 latent frames in the 2.1 VAE
TEXT_LENGTH = 16
MESH = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1, ici_context_parallelism=2)  # fsdp 4


def _grey_clip(levels, size=(16, 16)) -> np.ndarray:
    return np.stack([np.full((*size, 3), v, np.uint8) for v in levels])


# -- the video reader (no JAX) ------------------------------------------------------------------------------------


def test_read_frames_of_an_mp4_and_a_gif(tmp_path):
    """The frames picked (start, stride, count) of a clip written by ``write_video``, and of an animated GIF."""
    path = write_video(_grey_clip(LEVELS), tmp_path / "clip.mp4", fps=8, quality=10)
    every = read_frames(path, FrameSampling(count=12))
    assert every.shape == (12, 16, 16, 3) and every.dtype == np.uint8
    assert np.abs(every.mean(axis=(1, 2, 3)) - LEVELS).max() <= 3
    picked = read_frames(path, FrameSampling(count=3, stride=4, start=1))
    assert np.abs(picked.mean(axis=(1, 2, 3)) - LEVELS[[1, 5, 9]]).max() <= 3
    assert read_frames(path, FrameSampling(count=1, start=11)).shape == (1, 16, 16, 3)

    gif = tmp_path / "clip.gif"
    frames = [Image.fromarray(f) for f in _grey_clip(LEVELS[:5], (8, 12))]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=100, loop=0)
    got = read_frames(gif, FrameSampling(count=2, stride=2, start=2))
    assert got.shape == (2, 8, 12, 3) and np.abs(got.mean(axis=(1, 2, 3)) - LEVELS[[2, 4]]).max() <= 3


def test_read_frames_errors(tmp_path):
    path = write_video(_grey_clip(LEVELS), tmp_path / "clip.mp4", fps=8)
    with pytest.raises(DataError, match="not found"):
        read_frames(tmp_path / "missing.mp4")
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 10)
    with pytest.raises(DataError, match=r"video .*broken\.mp4 cannot be decoded"):
        read_frames(tmp_path / "broken.mp4", FrameSampling(count=2))
    with pytest.raises(DataError, match=r"has 12 frames; .* needs 14 .*at most 6 fit"):
        read_frames(path, FrameSampling(count=7, stride=2, start=1))
    with pytest.raises(ValueError, match=r"frames.stride=0 must be an int >= 1"):
        FrameSampling(stride=0)


def test_video_folder_source_checks_every_clip(tmp_path):
    """Clips with ``.txt`` captions; the header check (ffmpeg's frame count) names a short clip, a missing caption."""
    for name, n in (("long", 12), ("short", 5)):
        write_video(_grey_clip(LEVELS[:n]), tmp_path / f"{name}.mp4", fps=8)
        (tmp_path / f"{name}.txt").write_text(f"a {name} grey clip")
    source = VideoFolderSource(tmp_path, frames=FrameSampling(count=5))
    assert len(source) == 2 and source[0]["caption"] == "a long grey clip" and source[0]["video"].endswith("long.mp4")
    # a training run's data=FOLDER of clips (and no still images) is read as clips, with the run's frames
    assert holds_videos(tmp_path)
    kind, opened = open_source(TrainConfig(model="m", data=str(tmp_path), frames=FrameSampling(count=3, start=2),
                                           batch_size=2))
    assert kind == "source" and type(opened) is VideoFolderSource and opened.frames.start == 2
    Image.fromarray(_grey_clip([0])[0]).save(tmp_path / "still.png")
    assert not holds_videos(tmp_path)
    (tmp_path / "still.png").unlink()
    with pytest.raises(DataError, match=r"(?s)1 problem.*short\.mp4 has 5 frames; .* needs 9"):
        VideoFolderSource(tmp_path, frames=FrameSampling(count=5, stride=2))
    (tmp_path / "short.txt").unlink()
    with pytest.raises(DataError, match=r"short\.mp4: missing caption"):
        VideoFolderSource(tmp_path, frames=FrameSampling(count=5))


def test_clip_captions_are_cleaned_as_the_pipeline_cleans_prompts(tmp_path, monkeypatch):
    """Wan's bundle declares the pipeline's prompt cleaning: a clip's caption trains as the same prompt reads at
    inference; clip streams read one batch of records ahead, not image streams' eight."""
    import grain

    from eqxdiff.pipelines.wan import clean_prompt

    assert WanFlowMatching.CLEAN_CAPTION is clean_prompt and clean_prompt(" a  &amp;amp;\tb ") == "a & b"
    write_video(_grey_clip(LEVELS[:3]), tmp_path / "c.mp4", fps=8)
    (tmp_path / "c.txt").write_text("  two &amp;  grey\n")
    asked = []
    real = grain.ReadOptions
    monkeypatch.setattr(grain, "ReadOptions", lambda **kw: asked.append(kw) or real(**kw))
    tokenizer = character_tokenizer(16)

    def ids(**kwargs):
        return next(iter(make_dataset(VideoFolderSource(tmp_path, frames=FrameSampling(count=3)), batch_size=1,
                                      tokenizer=tokenizer, resolution=16, shuffle=False, **kwargs)))["input_ids"]

    np.testing.assert_array_equal(ids(clean_caption=WanFlowMatching.CLEAN_CAPTION), ids_of(tokenizer, "two & grey"))
    assert not np.array_equal(ids(), ids_of(tokenizer, "two & grey"))
    assert asked[0]["prefetch_buffer_size"] == 2


def test_samples_are_videos_as_the_clips_trained(folders):
    root, _ = folders
    assert WanFlowMatching.sample_size(_config(root)) == {"height": 16, "width": 16, "num_frames": FRAMES.count}


def ids_of(tokenizer, caption):
    return tokenizer([caption], padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="np").input_ids


def test_hf_dataset_of_clips_reads_as_the_folder_does(tmp_path, monkeypatch):
    """``hf_dataset`` whose ``video`` column holds clips (a path relative to the saved dataset, an absolute one,
    embedded bytes) opens as clips with the run's frames, the dataset loaded once (it says it holds clips, then the
    source reads it); its batches equal the folder source's; bad rows are named."""
    import datasets

    loads = []
    real_load = datasets.load_from_disk
    monkeypatch.setattr(datasets, "load_from_disk", lambda *a, **k: loads.append(a) or real_load(*a, **k))

    folder, saved = tmp_path / "folder", tmp_path / "saved"
    folder.mkdir()
    for name, levels in (("a", LEVELS), ("b", LEVELS[::-1])):
        write_video(_grey_clip(levels, (16, 24)), folder / f"{name}.mp4", fps=8, quality=10)
        (folder / f"{name}.txt").write_text(f"clip {name}")
    rows = {"video": ["clips/a.mp4", str(folder / "b.mp4")], "text": ["clip a", "clip b"]}
    datasets.Dataset.from_dict(rows).save_to_disk(saved)
    (saved / "clips").mkdir()
    shutil.copy(folder / "a.mp4", saved / "clips" / "a.mp4")
    frames = FrameSampling(count=3, stride=2, start=1)
    config = TrainConfig(model="m", hf_dataset=str(saved), frames=frames, batch_size=2, resolution=16)
    kind, source = open_source(config)
    assert kind == "source" and type(source) is HFVideoDatasetSource and source.frames == frames
    assert loads == [(str(saved),)]
    assert source[0]["video"] == str(saved / "clips" / "a.mp4") and source[1]["caption"] == "clip b"

    def batch(src):
        return next(iter(make_dataset(src, tokenizer=character_tokenizer(16), batch_size=2, resolution=16,
                                      shuffle=False, random_flip=False)))

    got, want = batch(source), batch(VideoFolderSource(folder, frames=frames))
    assert got["pixel_values"].shape == (2, 3, 16, 16, 3)
    np.testing.assert_array_equal(got["pixel_values"], want["pixel_values"])
    np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
    embedded = datasets.Dataset.from_dict({"video": [{"path": "b.mp4", "bytes": (folder / "b.mp4").read_bytes()}],
                                           "text": ["clip b"]})
    cached = HFVideoDatasetSource(embedded, frames=frames, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(read_frames(cached[0]["video"], frames), read_frames(folder / "b.mp4", frames))

    Image.fromarray(_grey_clip([0])[0]).save(folder / "still.png")  # an image dataset still opens as images
    still = datasets.Dataset.from_dict({"image": [str(folder / "still.png")], "text": ["a still"]})
    still.save_to_disk(tmp_path / "im")
    kind, images = open_source(dataclasses.replace(config, hf_dataset=str(tmp_path / "im"), batch_size=1))
    assert type(images) is HFDatasetSource and images[0]["image"].endswith("still.png")
    assert loads[1:] == [(str(tmp_path / "im"),)]

    with pytest.raises(DataError, match=r"missing column: image_column='clip' .* columns are \['video', 'text'\]"):
        HFVideoDatasetSource(saved, video_column="clip", frames=frames)
    rows["video"].append("clips/gone.mp4")
    rows["text"].append("gone")
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "bad")  # its clips/ folder is missing
    with pytest.raises(DataError, match=r"(?s)3 problem.*row 0 \(clips/a.mp4\): video file .*not found.*"
                                       r"row 1 .*b.mp4 has 12 frames; .* needs 13.*row 2 \(clips/gone.mp4\)"):
        open_source(dataclasses.replace(config, hf_dataset=str(tmp_path / "bad"), frames=FrameSampling(7, 2)))


# -- training ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny A14B folder (diffusers, every weight random) and a folder of one 12-frame 16x16 clip, 4 times."""
    root = tmp_path_factory.mktemp("wan_train")
    pipe = tiny.build_a14b(root / "pipe")
    clips = root / "clips"
    clips.mkdir()
    rng = np.random.default_rng(0)
    clip = np.clip(rng.normal(128, 40, (1, 16, 16, 3)) + np.arange(12)[:, None, None, None] * 6, 0, 255)
    for i in range(4):
        write_video(clip.astype(np.uint8), clips / f"{i}.mp4", fps=8, quality=10)
        (clips / f"{i}.txt").write_text("a red cat")
    return root, pipe


def _config(root, **changes) -> TrainConfig:
    settings = dict(model=str(root / "pipe"), data=str(root / "clips"), frames=FRAMES, resolution=16, batch_size=4,
                    steps=4, mesh=MESH, remat=Remat.FULL, cache_stream=True, random_flip=False,
                    family=WanOptions(max_sequence_length=TEXT_LENGTH), export_scheduler=None, log_every=1,
                    progress=False, optimizer=OptimizerConfig(learning_rate=3e-3, total_steps=4,
                                                              schedule="constant"))
    return TrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def runs(folders):
    """Four steps straight (a checkpoint at step 2), then a run from a copy of that checkpoint and of the cache."""
    root, _ = folders
    straight = run(_config(root, output_dir=root / "a", checkpoint_every=2))
    (root / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "a" / "checkpoints" / "2", root / "b" / "checkpoints" / "2")
    shutil.copytree(root / "a" / "cache", root / "b" / "cache")
    shutil.copy(root / "a" / "config.json", root / "b" / "config.json")
    resumed = run(_config(root, output_dir=root / "b", checkpoint_every=2))
    return straight, resumed


def _cache(root) -> dict[str, np.ndarray]:
    return {k: np.load(root / "a" / "cache" / f"{k}.npy") for k in WanFlowMatching.batch_keys(cached=True)}


def _leaves(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def single(folders, runs):
    """The bundle as a run builds it on one device (no mesh, no remat), its trainable half as loaded and as trained
    (the sharded run's params brought to the host), and the frozen half."""
    root, _ = folders
    (state, _, _), _ = runs
    setup = build(_config(root, mesh=None, remat=Remat.NONE))
    initial, frozen = eqx.partition(setup.model, setup.model.trainable())
    trained = jax.tree.unflatten(jax.tree.structure(initial), [np.asarray(x) for x in jax.tree.leaves(state.params)])
    return setup, initial, frozen, trained


def test_wan_trains_both_experts_the_loss_falls_and_resume_is_exact(folders, runs, single):
    """The cache holds diffusers' UMT5 embeddings of the captions (mask, zero padding) and video posteriors; both
    experts train, sharded; their loss on the cached clip at fixed draws falls; the resumed run is exact."""
    root, pipe = folders
    (state, frozen, losses), (resumed, _, resumed_losses) = runs
    cache = _cache(root)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(["a red cat"] * 4, do_classifier_free_guidance=False,
                                       max_sequence_length=TEXT_LENGTH)
    assert_close(cache["encoder_hidden_states"], embeds.numpy(), 1e-4, "cached UMT5 embeddings")
    assert cache["latent_mean"].shape == (4, 3, 2, 2, 16) and np.all(cache["latent_std"] > 0)

    assert len(losses) == 4 and all(np.isfinite(losses)) and int(state.step) == 4
    assert resumed_losses == losses[2:] and int(resumed.step) == 4
    for a, b in zip(_leaves(resumed), _leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    for name in ("transformer", "transformer_2"):
        params = jax.tree.leaves(getattr(state.params, name))
        assert params and any(not x.sharding.is_fully_replicated for x in params), name
    assert frozen.text_encoder is None and frozen.null_embeds is not None and frozen.boundary == 875.0

    setup, initial, frozen_one, trained = single
    loss = eqx.filter_jit(lambda p, b, k: batch_loss(p, frozen_one, b, k, scheduler=setup.noise_scheduler,
                                                     objective=_config(root).objective))
    batch = {k: jnp.asarray(v) for k, v in cache.items()}
    keys = jax.random.split(jax.random.key(11), 6)
    before = np.mean([float(loss(initial, batch, k)) for k in keys])
    after = np.mean([float(loss(trained, batch, k)) for k in keys])
    assert after < 0.9 * before, (before, after)


def test_export_loads_in_diffusers_and_its_experts_equal_ours(folders, single):
    """diffusers' ``WanPipeline`` loads the export with both experts and the boundary; each expert gives our trained
    expert's output on the same latents, timestep and text (1e-4), and the bundle's ``denoise`` gives each sample of a
    batch across the boundary its expert's."""
    from diffusers import WanPipeline

    root, pipe = folders
    _, _, frozen, trained = single
    exported = WanPipeline.from_pretrained(root / "a" / "pipeline")
    assert exported.config.boundary_ratio == 0.875 and exported.transformer_2 is not None
    ours = eqx.combine(trained, frozen)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 3, 2, 2, 16)).astype(np.float32)
    text = rng.standard_normal((1, TEXT_LENGTH, tiny.TEXT_DIM)).astype(np.float32)
    wants = []
    for name, t in (("transformer", 950.0), ("transformer_2", 300.0)):
        with torch.no_grad():
            want = getattr(exported, name)(torch.from_numpy(np.moveaxis(x, -1, 1)), torch.tensor([t]),
                                           torch.from_numpy(text)).sample.numpy()
        wants.append(np.moveaxis(want, 1, -1))
        got = jax.device_get(getattr(ours, name)(jnp.asarray(x), jnp.asarray([t]), jnp.asarray(text)))
        assert_close(got, wants[-1], 1e-4, name)
        original = getattr(pipe, name).state_dict()
        assert any(not torch.equal(v, original[k]) for k, v in getattr(exported, name).state_dict().items()), name
    # the training denoiser sends each sample of a mixed batch to the expert of its timestep (boundary 875)
    routed = ours.denoise(jnp.asarray(np.concatenate([x, x])), jnp.asarray([950.0, 300.0]),
                          {"encoder_hidden_states": jnp.asarray(np.concatenate([text, text]))})
    assert_close(jax.device_get(routed), np.concatenate(wants), 1e-4, "denoise of a mixed batch")


def test_expert_options_pick_the_trained_expert_and_its_timesteps(folders, tmp_path):
    """``family.expert``: high trains ``transformer`` on t >= 875 only, low ``transformer_2`` below (the training
    schedule restricted, in order), both both on all; a one-transformer folder refuses high/low."""
    root, _ = folders
    for expert, trained in (("high", "transformer"), ("low", "transformer_2"), ("both", None)):
        setup = build(_config(root, mesh=None, family=WanOptions(expert=expert, max_sequence_length=TEXT_LENGTH)))
        spec = setup.model.trainable()
        for name in ("transformer", "transformer_2"):
            marked = any(jax.tree.leaves(getattr(spec, name)))
            assert marked == (trained in (None, name)), (expert, name)
        timesteps, sigmas = setup.noise_scheduler.training_schedule()
        assert np.all(np.diff(timesteps) <= 0)
        if expert == "high":
            assert timesteps.min() >= 875 and timesteps.max() > 990
        elif expert == "low":
            assert timesteps.max() < 875 and timesteps.min() < 10
        else:
            assert timesteps.min() < 10 and timesteps.max() > 990
        np.testing.assert_allclose(sigmas * 1000, timesteps, rtol=1e-6)
    assert isinstance(setup.noise_scheduler, ExpertTimesteps) and setup.noise_scheduler.config.shift == 3.0
    # exported with scheduler=None: diffusers' FlowMatchEulerDiscreteScheduler on its config, not ExpertTimesteps
    from diffusers import FlowMatchEulerDiscreteScheduler

    export_pipeline(setup.model, setup.tokenizers, setup.noise_scheduler, tmp_path / "export", scheduler=None)
    written = json.loads((tmp_path / "export" / "scheduler" / "scheduler_config.json").read_text())
    assert written["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "export", subfolder="scheduler").config.shift == 3
    with pytest.raises(ValueError, match="expert='sideways'; choose one of"):
        WanOptions(expert="sideways")
    one = build(_config(root, mesh=None)).model
    with pytest.raises(ValueError, match="this folder has one transformer"):
        WanFlowMatching(transformer=one.transformer, transformer_2=None, text_encoder=None, vae=None,
                        null_input_ids=one.null_input_ids, options=WanOptions(expert="low"))


def test_expert_timesteps_are_drawn_evenly_over_each_range():
    """The experts' timestep draws (shift 3, boundary 875: ``t >= 875`` is 30% of the training schedule): training
    both, the high expert gets that share of the draws; ``high`` / ``low`` draw each timestep of their range equally
    often (a chi-square over the range's timesteps, bounded at 6 standard deviations of its null distribution: the
    earlier resampling to 1000 entries drew some timesteps twice as often as others). Sampling is the whole
    schedule's either way."""
    config, n = {"num_train_timesteps": 1000, "shift": 3.0}, 200_000
    whole = ExpertTimesteps.from_config(config)
    timesteps = whole.training_schedule()[0]
    key = jax.random.key(0)
    for expert_range in (None, (875.0, np.inf), (-np.inf, 875.0)):
        scheduler = ExpertTimesteps(whole.config, timestep_range=expert_range)
        drawn = np.asarray(jax.jit(lambda k, s=scheduler: flow_timesteps(k, n, s, Objective())[0])(key))
        if expert_range is None:
            share = float(np.mean(timesteps >= 875.0))
            assert abs(share - 0.3) < 0.01
            assert abs(np.mean(drawn >= 875.0) - share) < 5 * np.sqrt(share * (1 - share) / n)
            continue
        low, high = expert_range
        kept = timesteps[(timesteps >= low) & (timesteps < high)]
        values, counts = np.unique(drawn, return_counts=True)
        assert np.all(np.isin(values, kept)) and len(values) == len(kept), expert_range
        df, expected = len(kept) - 1, n / len(kept)
        chi2 = float(np.sum((counts - expected) ** 2 / expected))
        assert chi2 < df + 6 * np.sqrt(2 * df), (expert_range, chi2, df)
        sampling = scheduler.init(10).timesteps
        np.testing.assert_array_equal(np.asarray(sampling), np.asarray(whole.init(10).timesteps))


def test_eqxdiff_train_checks_the_clips_against_the_folder_before_loading(folders, tmp_path):
    """``eqxdiff-train wan2.1-1.3b --model FOLDER --data CLIPS``: a frame count the VAE cannot take (not 4k + 1) or a
    size the VAE and the transformer's patches cannot take is refused, naming the flag and a value that fits."""
    root, _ = folders
    argv = ["wan2.1-1.3b", "--model", str(root / "pipe"), "--data", str(root / "clips"), "--output-dir",
            str(tmp_path / "run"), "--resolution", "16", "--frames.count", "9"]
    config = train_cli.validate(argv)
    assert config.frames == FrameSampling(count=9) and type(config.family) is WanOptions
    with pytest.raises(InputError, match=r"^--frames.count 8 must be 1 \+ 4k .*; try --frames.count 5 or 9$"):
        train_cli.validate([*argv, "--frames.count", "8"])
    with pytest.raises(InputError, match=r"^--resolution 24 must be a multiple of 16 \(the VAE downsamples by 8 and "
                       r"the transformer takes 2x2 patches\); try --resolution 16$"):
        train_cli.validate([*argv, "--resolution", "24"])
    assert train_cli.validate([*argv, "--resolution", "16", "32"]).resolution == (16, 32)  # height width
    assert train_cli.validate([*argv, "--resolution", "32", "32"]).resolution == 32  # square: one size
    with pytest.raises(InputError, match=r"^--resolution 16 60 must be height and width multiples of 16 \(the VAE "
                       r"downsamples by 8 and the transformer takes 2x2 patches\); try --resolution 16 64$"):
        train_cli.validate([*argv, "--resolution", "16", "60"])
    for extra, message in ((["16", "32", "48"], "takes 1 or 2 values, got 3: 16 32 48"), (["16", "x"],
                                                                                        "expects integers, got 'x'")):
        with pytest.raises(ValueError, match=f"^--resolution {message}$"):
            train_cli.validate([*argv, "--resolution", *extra])
    # the family's options against the folder's model_index.json, before loading: no expand_timesteps here
    with pytest.raises(InputError, match=r"^--family.first-frame-probability 0.5 trains first-frame conditioning, .*"
                       r"set --family.first-frame-probability 0$"):
        train_cli.validate([*argv, "--family.first-frame-probability", "0.5"])
    assert train_cli.validate([*argv, "--family.expert", "high"]).family.expert == "high"  # this folder has two


def test_lora_on_both_experts_writes_one_file_per_expert(folders, tmp_path):
    """LoRA on Wan 2.2 A14B trains both experts (``family.expert='both'``): ``save_lora`` writes ``transformer``'s
    adapters to the file and ``transformer_2``'s to ``<stem>.transformer_2.safetensors`` in the same names, which
    eqxdiff's ``load_lora_weights(file, load_into_transformer_2=True)`` and diffusers' (same keyword, no unexpected
    or missing keys) read back into the low-noise expert: the loaded bundle gives the adapted bundle's output on each
    side of the boundary (<= 1e-4); ``expert='low'`` adapts and writes the second expert only."""
    import logging

    from eqxdiff.loading.lora import read_lora
    from eqxdiff.train import LoraConfig, add_lora, lora_filter, save_lora

    lora = LoraConfig(rank=2, alpha=3.0, targets=("attention", "mlp"))
    pipe = eqxdiff.load_pipeline(folders[0] / "pipe")
    base = WanFlowMatching.from_pipeline(pipe)[0]
    rng = np.random.default_rng(1)
    adapted = add_lora(base, lora, seed=0)
    adapted = jax.tree.map(lambda leaf, trains: jnp.asarray(0.3 * rng.standard_normal(leaf.shape), leaf.dtype)
                           if trains else leaf, adapted, lora_filter(adapted))
    assert adapted.trained_denoisers() == ("transformer", "transformer_2")
    written = save_lora(adapted, lora, tmp_path / "w.safetensors")
    second = tmp_path / "w.transformer_2.safetensors"
    assert written == f"{tmp_path / 'w.safetensors'} and {second}"
    assert {k.split(".")[0] for k in read_lora(second).tensors} == {"transformer"}

    batch = {"pixel_values": jnp.zeros((1, FRAMES.count, 16, 16, 3)),
             **{k: v[None] for k, v in adapted.null_ids().items()}}
    cond = adapted.condition(batch, jax.random.key(0), 0.0)
    x = jnp.asarray(rng.standard_normal((1, 3, 2, 2, base.transformer.config.in_channels)), jnp.float32)
    times = [jnp.asarray([base.boundary + 60.0]), jnp.asarray([base.boundary - 200.0])]  # one step per expert
    outputs = jax.jit(lambda b: [b.denoise(x, t, cond) for t in times])
    expected, plain = outputs(adapted), outputs(base)
    for e, p in zip(expected, plain):
        assert float(jnp.max(jnp.abs(e - p))) > 1e-2 * float(jnp.max(jnp.abs(p)))  # each expert's adapters count
    pipe.load_lora_weights(tmp_path / "w.safetensors", adapter_name="high")
    pipe.load_lora_weights(second, adapter_name="low", load_into_transformer_2=True)
    assert pipe.get_active_adapters() == ["high", "low"]  # one per expert, both on (diffusers keeps them per model)
    for got, want in zip(outputs(WanFlowMatching.from_pipeline(pipe)[0]), expected):
        assert_close(got, want, 1e-4, "the files loaded into both experts")

    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    ref = folders[1]  # the module's diffusers pipeline: its adapters are deleted after
    logging.getLogger("diffusers").addHandler(handler)
    try:
        ref.load_lora_weights(str(tmp_path / "w.safetensors"), adapter_name="high")
        ref.load_lora_weights(str(second), adapter_name="low", load_into_transformer_2=True)
        assert ref.transformer.active_adapters() == ["high"] and ref.transformer_2.active_adapters() == ["low"]
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
        ref.delete_adapters(["high", "low"])
    assert not [n for n in notices if "unexpected keys" in n or "missing keys" in n], notices

    low = dataclasses.replace(base, options=WanOptions(max_sequence_length=TEXT_LENGTH, expert="low"))
    assert low.trained_denoisers() == ("transformer_2",)
    only = add_lora(low, lora, seed=0)
    assert save_lora(only, lora, tmp_path / "low.safetensors") == str(tmp_path / "low.transformer_2.safetensors")



# -- Wan 2.2 TI2V: first-frame conditioning ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    """The tiny TI2V-5B-style folder (``expand_timesteps``, the 2.2 VAE) as a run builds it (no mesh)."""
    folder = tmp_path_factory.mktemp("wan_ti2v_train") / "pipe"
    tiny.build_ti2v(folder)
    return folder, build(TrainConfig(model=str(folder), family=WanOptions(max_sequence_length=TEXT_LENGTH)))


def test_ti2v_trains_first_frame_conditioned_samples_as_its_pipeline_denoises_them(ti2v, tmp_path):
    """``family.first_frame_probability`` 1: the transformer sees the clean first latent frame with the timestep 0 on
    its tokens (the sample's on the others) and the loss leaves that frame out (changing it changes nothing); 0: the
    step is the plain text-to-video one. A TI2V folder defaults to 0.5, another refuses a non-zero value; the export
    keeps ``expand_timesteps`` and loads in diffusers."""
    from diffusers import WanPipeline

    from eqxdiff.train import diffusion_loss

    folder, setup = ti2v
    assert setup.model.expand_timesteps and setup.model.first_frame_probability == 0.5
    seen = []

    class Spy(eqx.Module):  # the transformer's stand-in: records its inputs, mixes nothing across frames
        config: object = eqx.field(static=True)
        record: object = eqx.field(static=True)

        def __call__(self, x, t, text):
            self.record(x, t)
            return 2.0 * x

    spied = eqx.tree_at(lambda m: m.transformer, setup.model, Spy(setup.model.transformer.config,
                                                                  lambda x, t: seen.append((x, t))))
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((2, 3, 4, 4, 48)).astype(np.float32)  # 3 latent frames of 2x2 patches of 2x2
    batch = {"latent_mean": jnp.asarray(mean), "latent_std": jnp.zeros_like(mean),
             "encoder_hidden_states": jnp.asarray(rng.standard_normal((2, TEXT_LENGTH, tiny.TEXT_DIM)), jnp.float32)}
    objective, key = Objective(prediction_type="flow_prediction"), jax.random.key(3)

    def loss(p, batch):
        model = dataclasses.replace(spied, options=WanOptions(max_sequence_length=TEXT_LENGTH,
                                                              first_frame_probability=p))
        return float(batch_loss(*eqx.partition(model, False), batch, key, scheduler=setup.noise_scheduler,
                                objective=objective))

    x0 = np.asarray(setup.model.vae.scale_latents(jnp.asarray(mean)))
    plain, conditioned = loss(0.0, batch), loss(1.0, batch)
    (x_plain, t_plain), (x_cond, t_cond) = seen
    assert t_plain.shape == (2,) and t_cond.shape == (2, 3 * 2 * 2)
    np.testing.assert_array_equal(x_cond[:, 0], x0[:, 0])  # the clean first frame
    np.testing.assert_array_equal(x_cond[:, 1:], x_plain[:, 1:])  # the others noised as in text-to-video
    assert np.abs(x_plain[:, 0] - x0[:, 0]).max() > 1e-2
    np.testing.assert_array_equal(t_cond[:, :4], 0.0)  # the first frame's 4 tokens at timestep 0
    np.testing.assert_array_equal(t_cond[:, 4:], np.broadcast_to(np.asarray(t_plain)[:, None], (2, 8)))
    moved = {**batch, "latent_mean": batch["latent_mean"].at[:, 0].add(5.0)}  # the first frame's target changes
    assert loss(1.0, moved) == conditioned and loss(0.0, moved) != plain

    k_latent, _, k_loss = jax.random.split(key, 3)  # probability 0: the loss as it was before the hook
    today = diffusion_loss(spied.denoise, setup.noise_scheduler, objective, spied.latents(batch, k_latent),
                           spied.condition(batch, k_latent, 0.0), k_loss)
    assert float(today) == plain

    with pytest.raises(ValueError, match=r"first_frame_probability=0.5 .*expand_timesteps.*set family\."
                                         r"first_frame_probability=0"):
        WanFlowMatching(transformer=None, transformer_2=None, text_encoder=None, vae=None,
                        null_input_ids=setup.model.null_input_ids, options=WanOptions(first_frame_probability=0.5))
    with pytest.raises(ValueError, match=r"first_frame_probability=1.5 must be in \[0, 1\]"):
        WanOptions(first_frame_probability=1.5)
    export_pipeline(setup.model, setup.tokenizers, setup.noise_scheduler, tmp_path / "export",
                    scheduler=setup.scheduler, options=setup.options)
    assert WanPipeline.from_pretrained(tmp_path / "export").config.expand_timesteps is True


def test_eqxdiff_train_checks_the_family_options_against_a_ti2v_folder_before_loading(folders, ti2v, tmp_path):
    """On the TI2V folder (one transformer, ``expand_timesteps``) first-frame conditioning is taken and one A14B
    expert is refused, from ``model_index.json`` before anything loads."""
    (root, _), (folder, _) = folders, ti2v
    argv = ["wan2.2-ti2v-5b", "--model", str(folder), "--data", str(root / "clips"), "--output-dir",
            str(tmp_path / "run"), "--resolution", "32", "--frames.count", "9"]
    assert train_cli.validate([*argv, "--family.first-frame-probability", "1.0"]).family.first_frame_probability == 1
    with pytest.raises(InputError, match=r"^--family.expert .?high.? picks one of Wan 2.2 A14B's two experts, but "
                       r"this folder has one transformer: set --family.expert .?both.?$"):
        train_cli.validate([*argv, "--family.expert", "high"])


def test_a_ti2v_run_samples_image_to_video_from_the_first_frame_of_its_first_clip(folders, ti2v, tmp_path,
                                                                                   monkeypatch):
    """A TI2V run's sampler with ``first_frame_probability`` 1 draws its samples with ``WanImageToVideoPipeline``
    (the text-to-video pipeline not at all), from the first frame of the dataset's first clip as the run reads it
    (the stream's pixels at the run's size, the frame ``frames.start`` picks: closer to it than to any other of the
    clip's frames); the videos are logged as an MP4 of every frame and a PNG. (The sampler as ``run`` builds it, on
    the loaded weights: a training step would add a compile and nothing to what is checked.)"""
    import functools
    import types

    import imageio_ffmpeg

    from eqxdiff.pipelines import read_video
    from eqxdiff.pipelines.wan import WanPipeline
    from eqxdiff.pipelines.wan_i2v import WanImageToVideoPipeline
    from eqxdiff.train import _run as run_module
    from eqxdiff.train._metrics import MetricsLogger

    (root, _), (folder, _) = folders, ti2v
    calls = []
    for cls in (WanPipeline, WanImageToVideoPipeline):
        def spy(self, *args, real=cls.__call__, **kwargs):
            calls.append((type(self).__name__, kwargs))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", functools.wraps(cls.__call__)(spy))
    frames = FrameSampling(count=5, start=2)
    config = TrainConfig(model=str(folder), data=str(root / "clips"), frames=frames, resolution=32, batch_size=1,
                         random_flip=False, family=WanOptions(max_sequence_length=TEXT_LENGTH,
                                                              first_frame_probability=1.0),
                         sample_prompts=("a red cat",), sample_steps=2, sample_guidance_scale=2.0)
    setup, source = build(config), open_source(config)[1]
    state = types.SimpleNamespace(model=lambda frozen, use_ema: setup.model)
    videos, fps = run_module._sampler(config, setup, setup.scheduler, None, {}, source)(state)
    assert [name for name, _ in calls] == ["WanImageToVideoPipeline"] and videos.shape == (1, 5, 32, 32, 3)
    assert fps == 24  # TI2V-5B's frame rate (expand_timesteps), which the sample video plays at
    image = calls[0][1]["image"]
    clip = next(iter(setup.stream(config, source, shuffle=False)))["pixel_values"][0]  # [5, 32, 32, 3] in [-1, 1]
    assert image.shape == (32, 32, 3)
    np.testing.assert_allclose(image, (clip[0] + 1) / 2, atol=1e-6)
    distances = [np.abs(image - (frame + 1) / 2).mean() for frame in clip]
    assert np.argmin(distances) == 0 and min(distances[1:]) > 0.01  # the clip's frames differ: the first one it is
    assert calls[0][1]["prompt"] == ["a red cat"] and calls[0][1]["num_frames"] == 5

    MetricsLogger(tmp_path, total_steps=1, tensorboard=False, progress=False).images(1, "samples", videos, fps)
    written = read_video(tmp_path / "samples" / "samples_0000001.mp4")
    meta = next(imageio_ffmpeg.read_frames(str(tmp_path / "samples" / "samples_0000001.mp4")))
    assert meta["fps"] == 24
    assert written.shape == (5, 34, 34, 3)  # the grid of one video: 32 pixels and a pad of 1 on each side
    means = written[:, 1:-1, 1:-1].mean(axis=(1, 2)), videos[0].mean(axis=(1, 2))  # each frame's colour, [5, 3]
    assert np.abs(means[0] - means[1]).max() < 8  # as sampled, give or take H.264 (which smooths the random detail)
    assert (tmp_path / "samples" / "samples_0000001.png").is_file()


def test_ti2v_samples_show_the_tasks_the_run_trains(ti2v, capsys):
    """``sample_calls``: text-to-video alone at probability 0 (the data not read), both tasks in between (the
    image-to-video one from the example's first frame, in [0, 1]), image-to-video alone at 1; an example without
    pixels gives text-to-video samples and a log line saying why."""
    _, setup = ti2v
    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1, 1, (1, 5, 32, 32, 3)).astype(np.float32)

    def bundle(p):
        return dataclasses.replace(setup.model, options=WanOptions(max_sequence_length=TEXT_LENGTH,
                                                                   first_frame_probability=p))

    def unread():
        raise AssertionError("the data is read for text-to-video samples")

    assert bundle(0.0).sample_calls(unread) == (("WanPipeline", {}),)
    t2v, i2v = bundle(0.5).sample_calls(lambda: {"pixel_values": pixels, "input_ids": np.zeros((1, 4), np.int32)})
    assert t2v == ("WanPipeline", {}) and i2v.pipeline == "WanImageToVideoPipeline"
    np.testing.assert_allclose(i2v.inputs["image"], (pixels[0, 0] + 1) / 2, atol=1e-6)
    (only,) = bundle(1.0).sample_calls(lambda: {"pixel_values": pixels})
    assert only.pipeline == "WanImageToVideoPipeline"
    assert bundle(1.0).sample_calls(lambda: {"latent_mean": pixels}) == (("WanPipeline", {}),)
    assert "samples are text-to-video only, though first_frame_probability=1.0 trains" in capsys.readouterr().out


def _non_square(root, tmp_path):
    return _config(root, resolution=(16, 32), frames=FrameSampling(count=5), batch_size=2, steps=1, mesh=None,
                   remat=Remat.NONE, cache_stream=False, output_dir=tmp_path / "run",
                   family=WanOptions(expert="high", max_sequence_length=TEXT_LENGTH))


def test_a_non_square_size_trains(folders, tmp_path):
    """A step trains on ``[2, 5, 16, 32, 3]`` clips (one expert, one device)."""
    _, _, losses = run(_non_square(folders[0], tmp_path))
    assert len(losses) == 1 and np.isfinite(losses[0])


def test_a_non_square_size_reads_and_a_bad_one_is_refused(folders, tmp_path):
    """``resolution=(height, width)``: the clips' batches are ``[b, frames, 16, 32, 3]`` and the samples take that
    size; a size that is not one or two sides >= 1, and non-square digits, are refused."""
    config = _non_square(folders[0], tmp_path)
    assert config.size == (16, 32) and WanFlowMatching.sample_size(config) == {"height": 16, "width": 32,
                                                                               "num_frames": 5}
    setup = build(config)
    batch = next(iter(setup.stream(config, open_source(config)[1])))
    assert batch["pixel_values"].shape == (2, 5, 16, 32, 3)
    for bad in ((16, 0), (16, 32, 48), "16"):
        with pytest.raises(ValueError, match=r"resolution=.* must be one size >= 1 \(square\) or two, height and"):
            TrainConfig(resolution=bad)
    with pytest.raises(ValueError, match=r"^resolution=\(16, 32\) is not square, but data='digits' upscales square"):
        TrainConfig(resolution=(16, 32))
