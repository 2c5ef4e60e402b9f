"""Flux fine-tuning on the shared train stack (issue 12): ``train.run`` on a tiny FLUX.1-dev-style pipeline folder
built with diffusers (guidance embedder, dynamically shifted scheduler), latents and text embeddings cached, on an
FSDP mesh of the 8 simulated devices with full remat: the loss falls, a resumed run continues exactly, and
diffusers' ``FluxPipeline`` loads the export. The pieces against diffusers: the cached prompt embeddings
(``encode_prompt``) and VAE posterior, and the loss of a batch against diffusers' ``train_dreambooth_flux.py``
recipe (density draws, the scheduler's training sigmas, packing, guidance 3.5, SD3 loss weighting) computed with
diffusers' transformer. One compiled step program serves both runs."""

import dataclasses
import json
import shutil
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff.core import leaf_specs
from eqxdiff.data import ImageFolderSource
from eqxdiff.parallel import MeshConfig, Remat
from eqxdiff.train import (
    FamilyOptions,
    FluxFlowMatching,
    FluxOptions,
    Objective,
    OptimizerConfig,
    TrainConfig,
    batch_loss,
    build,
    family_options,
    flow_density,
    run,
)
from eqxdiff.train import _run as run_module
from eqxdiff.train._sources import stream

from . import _tiny_flux_pipeline
from ._util import rel_error

RESOLUTION = 8  # the dev variant's VAE keeps the size (factor 1): 8x8 latents of 1 channel, 16 packed tokens
T5_LENGTH = 24  # T5's caption length (its character tokenizer says 16: Flux's max_sequence_length option wins)
SIZES = [(12, 8), (8, 8), (10, 14), (16, 9), (9, 12), (8, 20), (11, 11), (18, 10)]  # (height, width)
FSDP = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1)
OBJECTIVE = Objective(weighting_scheme="logit_normal", logit_mean=0.3, logit_std=0.8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Flux dev pipeline (diffusers, every weight random) saved to a folder, and 8 captioned images."""
    from PIL import Image

    root = tmp_path_factory.mktemp("flux_train")
    pipe = _tiny_flux_pipeline.build(root / "pipe", "dev")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a {'red green blue black white pink gold grey'.split()[i]} fox")
    return root, pipe


def _config(root, **changes) -> TrainConfig:
    settings = dict(model=str(root / "pipe"), data=str(root / "images"), resolution=RESOLUTION, batch_size=8,
                    steps=4, mesh=FSDP, remat=Remat.FULL, cache_stream=True,
                    family=FluxOptions(max_sequence_length=T5_LENGTH),
                    export_scheduler=None, log_every=1, progress=False, objective=OBJECTIVE,
                    optimizer=OptimizerConfig(learning_rate=3e-3, total_steps=4, schedule="constant"))
    return TrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def runs(folders):
    """Four steps straight (a checkpoint at step 2), then a second run from a copy of that checkpoint and of the
    cache, resuming at step 2 (the same compiled step program)."""
    root, _ = folders
    straight = run(_config(root, output_dir=root / "a", checkpoint_every=2))
    (root / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "a" / "checkpoints" / "2", root / "b" / "checkpoints" / "2")
    shutil.copytree(root / "a" / "cache", root / "b" / "cache")
    shutil.copy(root / "a" / "config.json", root / "b" / "config.json")
    resumed = run(_config(root, output_dir=root / "b", checkpoint_every=2))
    return straight, resumed


def _cache(root, rows=slice(None)) -> dict[str, np.ndarray]:
    return {k: np.load(root / "a" / "cache" / f"{k}.npy")[rows] for k in FluxFlowMatching.batch_keys(cached=True)}


def test_cache_holds_what_diffusers_encodes(folders, runs):
    """The cached text embeddings are diffusers' ``FluxPipeline.encode_prompt`` of each caption (T5 at the run's
    ``FluxOptions.max_sequence_length``, CLIP's pooled output), the cached posterior diffusers' VAE's on the same pixels."""
    root, pipe = folders
    cache = _cache(root)
    source = ImageFolderSource(root / "images")
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(source.captions, None, max_sequence_length=T5_LENGTH)
    assert cache["encoder_hidden_states"].shape == (8, T5_LENGTH, 32)
    assert rel_error(cache["encoder_hidden_states"], embeds.numpy()) <= 1e-4
    assert rel_error(cache["pooled_projections"], pooled.numpy()) <= 1e-4
    setup = build(_config(root, mesh=None))
    (batch,) = list(stream(_config(root), source, setup.text_tokenizers, max_length=setup.text_lengths,
                           shuffle=False, num_epochs=1, drop_remainder=False))
    with torch.no_grad():
        dist = pipe.vae.encode(torch.from_numpy(np.moveaxis(batch["pixel_values"], -1, 1))).latent_dist
    assert rel_error(cache["latent_mean"], np.moveaxis(dist.mean.numpy(), 1, -1)) <= 1e-4
    assert rel_error(cache["latent_std"], np.moveaxis(dist.std.numpy(), 1, -1)) <= 1e-4


@pytest.fixture(scope="module")
def single_device(folders):
    """The bundle as a run builds it (one device), its noise scheduler, and ``batch_loss`` jitted per objective."""
    root, _ = folders
    setup = build(_config(root, mesh=None))
    params, frozen = eqx.partition(setup.model, setup.model.trainable())
    loss = eqx.filter_jit(lambda p, f, b, k, objective: batch_loss(p, f, b, k, scheduler=setup.noise_scheduler,
                                                                   objective=objective))
    return setup, params, frozen, loss


@pytest.mark.parametrize("objective", [OBJECTIVE, Objective(weighting_scheme="cosmap")], ids=["logit_normal",
                                                                                                 "cosmap"])
def test_loss_is_diffusers_recipe(folders, runs, single_device, objective):
    """A batch's loss equals diffusers' Flux recipe on the same draws: ``u`` from the density, ``indices =
    int(u * 1000)`` into the scheduler's training ``timesteps``/``sigmas``, ``x_t = (1 - sigma) x0 + sigma noise``
    with ``x0 = (z - shift) * scale``, packed; the transformer at ``timestep = t / 1000`` with guidance 3.5 and
    zero text ids; unpacked; MSE to ``noise - x0`` weighted by ``compute_loss_weighting_for_sd3``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    root, pipe = folders
    _, params, frozen, loss_fn = single_device
    batch = _cache(root, slice(0, 4))
    key = jax.random.key(3)
    ours = float(loss_fn(params, frozen, {k: jnp.asarray(v) for k, v in batch.items()}, key, objective))

    # the draws batch_loss makes from `key` (latent sample, then the flow-matching loss's time and noise keys)
    k_latent, _, k_loss = jax.random.split(key, 3)
    k_t, k_noise = jax.random.split(k_loss)
    z = batch["latent_mean"] + batch["latent_std"] * np.asarray(jax.random.normal(k_latent, batch["latent_mean"].shape))
    draws = (jax.random.normal if objective.weighting_scheme == "logit_normal" else jax.random.uniform)(k_t, (4,))
    u = np.asarray(flow_density(objective.weighting_scheme, draws, logit_mean=objective.logit_mean,
                                logit_std=objective.logit_std, mode_scale=objective.mode_scale))
    noise = np.array(jax.random.normal(k_noise, z.shape))  # writable, for torch

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "pipe", subfolder="scheduler")
    indices = torch.from_numpy((u * scheduler.config.num_train_timesteps).astype(np.int64))
    timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices].reshape(-1, 1, 1, 1)
    vae = pipe.vae.config
    x0 = (torch.from_numpy(np.moveaxis(z, -1, 1)) - vae.shift_factor) * vae.scaling_factor
    eps = torch.from_numpy(np.moveaxis(noise, -1, 1))
    noisy = (1.0 - sigmas) * x0 + sigmas * eps
    b, c, h, w = noisy.shape
    with torch.no_grad():
        pred = pipe.transformer(
            hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w), timestep=timesteps / 1000,
            guidance=torch.full((b,), 3.5), pooled_projections=torch.from_numpy(batch["pooled_projections"]),
            encoder_hidden_states=torch.from_numpy(batch["encoder_hidden_states"]),
            txt_ids=torch.zeros(T5_LENGTH, 3), img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu",
                                                                                              torch.float32)).sample
    pred = FluxPipeline._unpack_latents(pred, h, w, 1)
    weighting = compute_loss_weighting_for_sd3(objective.weighting_scheme, sigmas)
    want = torch.mean((weighting * (pred - (eps - x0)) ** 2).reshape(b, -1), 1).mean()
    assert abs(ours - float(want)) <= 1e-4 * abs(float(want))
    if objective.weighting_scheme == "cosmap":
        assert not torch.allclose(weighting, torch.ones_like(weighting))


def _leaves(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def test_flux_trains_on_the_fsdp_mesh_the_loss_falls_and_resume_is_exact(folders, runs, single_device):
    """The run trains the transformer (sharded over fsdp, remat at its blocks, text encoders off the devices); its
    loss on the cached data at fixed draws falls; the resumed run continues it exactly (the same losses at steps 3
    and 4, the same state array for array)."""
    root, _ = folders
    (state, frozen, losses), (resumed, _, resumed_losses) = runs
    assert len(losses) == 4 and all(np.isfinite(losses)) and int(state.step) == 4
    assert resumed_losses == losses[2:] and int(resumed.step) == 4
    for a, b in zip(_leaves(resumed), _leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    params = jax.tree.leaves(state.params)
    assert params and all(len(x.sharding.device_set) == 8 for x in params)
    assert any(not x.sharding.is_fully_replicated for x in params)
    assert frozen.text_encoder is None and frozen.text_encoder_2 is None and frozen.null_embeds is not None
    assert frozen.transformer.plan.remat is Remat.FULL
    assert frozen.options == FluxOptions(guidance_scale=3.5, max_sequence_length=T5_LENGTH)

    _, initial, frozen_one, loss_fn = single_device
    transformer = jax.tree.unflatten(jax.tree.structure(initial.transformer),
                                     [np.asarray(x) for x in jax.tree.leaves(state.params.transformer)])
    trained = eqx.tree_at(lambda m: m.transformer, initial, transformer)
    batch = {k: jnp.asarray(v) for k, v in _cache(root).items()}
    keys = jax.random.split(jax.random.key(11), 6)
    before = np.mean([float(loss_fn(initial, frozen_one, batch, k, OBJECTIVE)) for k in keys])
    after = np.mean([float(loss_fn(trained, frozen_one, batch, k, OBJECTIVE)) for k in keys])
    assert after < 0.9 * before, (before, after)


def test_export_loads_in_diffusers(folders, runs):
    """diffusers' ``FluxPipeline`` loads the exported folder: its transformer holds the trained weights (every
    tensor), the encoders and VAE are the original ones, the scheduler is the folder's; and it generates."""
    from diffusers import FluxPipeline

    root, pipe = folders
    (state, frozen, _), _ = runs
    exported = FluxPipeline.from_pretrained(root / "a" / "pipeline")
    leaves, specs, _ = leaf_specs(state.model(frozen).transformer)
    got, original = exported.transformer.state_dict(), pipe.transformer.state_dict()
    assert sorted(s.name for s in specs) == sorted(got)
    changed = 0
    for leaf, spec in zip(leaves, specs):
        ours = np.asarray(leaf)
        if spec.perm is not None:
            ours = np.transpose(ours, np.argsort(spec.perm))
        np.testing.assert_array_equal(got[spec.name].numpy(), ours, err_msg=spec.name)
        changed += not np.array_equal(ours, original[spec.name].numpy())
    assert changed > len(specs) // 2
    for name in ("text_encoder", "text_encoder_2", "vae"):
        got, want = getattr(exported, name).state_dict(), getattr(pipe, name).state_dict()
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    configs = [{k: v for k, v in json.loads((f / "scheduler" / "scheduler_config.json").read_text()).items()
                if not k.startswith("_")} for f in (root / "a" / "pipeline", root / "pipe")]
    assert type(exported.scheduler) is type(pipe.scheduler) and configs[0] == configs[1]
    exported.set_progress_bar_config(disable=True)
    images = exported("a red fox", num_inference_steps=2, height=16, width=16, max_sequence_length=T5_LENGTH,
                      output_type="np", generator=torch.manual_seed(0)).images
    assert images.shape == (1, 16, 16, 3) and np.all(np.isfinite(images))


def test_samples_call_the_pipeline_with_the_options_as_trained(folders, single_device, monkeypatch):
    """The run's samples go through the family's pipeline with ``call_options`` (T5 at the trained length) beside
    the sample settings; the pipeline is a stand-in that records its call (nothing compiles)."""
    root, _ = folders
    setup = single_device[0]
    assert setup.model.call_options() == {"max_sequence_length": T5_LENGTH}
    calls = []

    def pipeline(self, tokenizers, scheduler, **kwargs):
        assert tokenizers is setup.tokenizers and scheduler == "the scheduler"
        return lambda prompt, **call: calls.append((prompt, call))

    monkeypatch.setattr(FluxFlowMatching, "pipeline", pipeline)
    config = _config(root, sample_prompts=("a red fox",), sample_steps=3, sample_guidance_scale=2.0)
    state = types.SimpleNamespace(model=lambda frozen, use_ema: setup.model)
    assert setup.model.sample_size(config) == {}  # images at the pipeline's default size
    run_module._sampler(config, setup, "the scheduler", frozen=None, encoders={})(state)
    assert calls == [(["a red fox"], dict(num_inference_steps=3, guidance_scale=2.0, seed=0, progress=False,
                                          max_sequence_length=T5_LENGTH))]


def test_flux_options_errors(folders, single_device):
    """Flux's options a user can get wrong, and options of one family given to another."""
    from eqxdiff.train import SDXLLatentDiffusion

    with pytest.raises(ValueError, match=r"max_sequence_length=513 must be in \[1, 512\]"):
        FluxOptions(max_sequence_length=513)
    with pytest.raises(ValueError, match="guidance_scale=nan must be finite"):
        FluxOptions(guidance_scale=float("nan"))
    with pytest.raises(TypeError, match="family=3.5 must be a family's options"):
        TrainConfig(family=3.5)
    assert family_options(FamilyOptions(), FluxFlowMatching, "x") == FluxOptions()  # the family's defaults
    given = FluxOptions(guidance_scale=2.0)
    assert family_options(given, FluxFlowMatching, "x") is given
    with pytest.raises(ValueError, match=r"family=FluxOptions\(guidance_scale=2.0, max_sequence_length=512\) holds "
                       r"another family's options, but model 'x' trains as SDXLLatentDiffusion, which takes no family "
                       r"options"):
        family_options(given, SDXLLatentDiffusion, "model 'x'")
    root, _ = folders
    with pytest.raises(ValueError, match=r"model=.*pipe' \(a FluxPipeline\) trains as FluxFlowMatching, which takes "
                       r"options \['guidance_scale', 'max_sequence_length'\] \(FluxOptions\)"):
        build(dataclasses.replace(_config(root, mesh=None), family=_OtherOptions()))
    b = single_device[0].model
    with pytest.raises(TypeError, match=r"FluxFlowMatching takes FluxOptions options, got FamilyOptions\(\)"):
        FluxFlowMatching(b.transformer, b.text_encoder, b.text_encoder_2, b.vae, b.null_input_ids,
                         b.null_input_ids_2, options=FamilyOptions())


@dataclasses.dataclass(frozen=True)
class _OtherOptions(FamilyOptions):
    """Some other family's options."""

    strength: float = 1.0
