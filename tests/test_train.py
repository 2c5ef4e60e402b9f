"""eqxdiff.train: objectives against hand-computed values, the train step, accumulation, checkpoints that resume
exactly (without recompiling), FSDP and FSDP + data meshes of the 8 simulated CPU devices equal to one device,
``train.run`` end to end from each data source, and the errors a user can hit."""

import dataclasses
import json
import os
import shutil
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.data import character_tokenizer
from eqxdiff.parallel import MeshConfig, Plan, make_mesh, shard_params, with_plan
from eqxdiff.schedulers import DDPMScheduler
from eqxdiff.train import (
    ArrayBatches,
    Checkpointer,
    DataError,
    DigitsArchitecture,
    Objective,
    OptimizerConfig,
    TimestepBias,
    TrainConfig,
    batch_loss,
    cache_arrays,
    check_batch,
    data_parallel_mesh,
    diffusion_loss,
    fit,
    flow_matching_pair,
    init_state,
    make_optimizer,
    min_snr_weights,
    offset_noise,
    shard_batch,
    shard_state,
    snr,
    target,
    train_step,
    trainable_filter,
)
import eqxdiff
from eqxdiff.train import CheckpointMismatchError, TrainingInterrupted, run
from eqxdiff.train import _autoencoder as autoencoder_module
from eqxdiff.train import _setup as train_setup
from eqxdiff.train._config import run_settings
from eqxdiff.train._digits import SD_NOISE_SCHEDULE

from ._util import assert_close_to_float64, assert_leaves_close_to_float64, run_float64

TINY = DigitsArchitecture(image_size=8, vae_channels=(8, 8), latent_channels=4, unet_channels=(8,),
                          attention_heads=2, text_hidden_size=8, text_layers=1, text_heads=2, norm_num_groups=4)
# The scheduler, objective and optimizer train.run uses for RUN (below), so the direct steps on its mesh and its runs
# share one compiled program. The optimizer accumulates 2 micro-steps per update, and its eps = 1 makes the update a
# smooth function of the gradient (lr * m / (sqrt(v) + 1)): Adam's usual eps = 1e-8 turns a gradient of 1e-9 into a
# full-size step of either sign, so rounding noise in ~zero gradients would decide whole updates and no float32
# comparison of sharded against single-device params could be tight.
SCHED = DDPMScheduler.from_config({**SD_NOISE_SCHEDULE, "prediction_type": "epsilon"})
OBJECTIVE = Objective(prediction_type="epsilon", caption_dropout=0.3, snr_gamma=5.0)
OPT = OptimizerConfig(learning_rate=1.0, eps=1.0, weight_decay=0.0, warmup_steps=0, total_steps=100,
                      schedule="constant", accumulation_steps=2)
KW = dict(scheduler=SCHED, objective=OBJECTIVE, ema_decay=0.9)
FSDP_DATA = MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1)
RUN = TrainConfig(resolution=8, batch_size=8, steps=1, architecture=TINY, objective=OBJECTIVE, optimizer=OPT,
                  ema_decay=0.9, mesh=FSDP_DATA, log_every=1, progress=False)


@pytest.fixture(scope="module")
def tiny():
    """RUN's tiny LatentDiffusion (one UNet level with cross-attention, latents 4x4x4), 32 samples of pixels and
    token ids, and the same samples encoded by ``cache_arrays``."""
    from eqxdiff.train._setup import build_model

    model, tok, sched = build_model(RUN)
    assert sched.config == SCHED.config
    rng = np.random.default_rng(0)
    ids = tok([f"digit {w}" for w in ("one", "two", "three", "four")] * 8, padding="max_length",
              max_length=tok.model_max_length, return_tensors="np").input_ids.astype(np.int32)
    arrays = {"pixel_values": rng.uniform(-1, 1, (32, 8, 8, 3)).astype(np.float32), "input_ids": ids}
    return model, arrays, cache_arrays(model, arrays, log=lambda *_: None)


# -- objectives, by hand ---------------------------------------------------------------------------------------

def _exactly(ours, exact, what):
    """Float32 ``ours`` against an exact value (float64): as close as that value rounded once to float32, up to the
    slack of the few roundings a float32 formula makes, value by value."""
    exact = np.asarray(exact, np.float64)
    assert_close_to_float64(ours, exact.astype(np.float32), exact, what=what, elementwise=True)


def test_min_snr_weights_by_hand():
    s = jnp.asarray([0.25, 1.0, 5.0, 40.0])
    gamma = 5.0
    _exactly(min_snr_weights(s, gamma, "epsilon"), [1.0, 1.0, 1.0, 5.0 / 40.0], "epsilon")
    _exactly(min_snr_weights(s, gamma, "v_prediction"), [0.25 / 1.25, 1.0 / 2.0, 5.0 / 6.0, 5.0 / 41.0], "v")
    _exactly(min_snr_weights(s, gamma, "sample"), [0.25, 1.0, 5.0, 5.0], "sample")
    acp = SCHED.alphas_cumprod
    t = jnp.asarray([0, 499, 999])
    a = acp[[0, 499, 999]]  # float32 values: the formula on them, in float32 and in float64
    assert_close_to_float64(snr(acp, t), a / (1 - a), a.astype(np.float64) / (1 - a.astype(np.float64)), what="snr",
                            elementwise=True)


def test_v_prediction_target_is_ddpm_velocity(getkey):
    x = jax.random.normal(getkey(), (3, 4, 4, 4))
    noise = jax.random.normal(getkey(), (3, 4, 4, 4))
    t = jnp.asarray([10, 500, 990])
    v = target(SCHED, "v_prediction", x, noise, t)
    np.testing.assert_array_equal(v, SCHED.get_velocity(x, noise, t))  # the same function on the same inputs
    acp = SCHED.alphas_cumprod[[10, 500, 990]].reshape(3, 1, 1, 1)
    expected = np.sqrt(acp) * np.asarray(noise) - np.sqrt(1 - acp) * np.asarray(x)  # float32, as NumPy rounds
    acp, noise64, x64 = (np.asarray(a, np.float64) for a in (acp, noise, x))
    assert_close_to_float64(v, expected, np.sqrt(acp) * noise64 - np.sqrt(1 - acp) * x64, what="velocity")
    np.testing.assert_array_equal(target(SCHED, "epsilon", x, noise, t), noise)  # the noise itself, returned
    np.testing.assert_array_equal(target(SCHED, "sample", x, noise, t), x)


@pytest.mark.parametrize("kind,gamma", [("epsilon", None), ("epsilon", 5.0), ("v_prediction", 5.0)])
def test_diffusion_loss_by_hand(getkey, kind, gamma):
    """A denoiser that records its inputs and predicts zero: the loss is the weighted mean square of the target,
    recomputed here in float64 from the recorded noisy latents and timesteps."""
    x0 = np.asarray(jax.random.normal(getkey(), (4, 4, 4, 4)), np.float64)
    seen = {}

    def denoiser(noisy, t, context):
        seen["noisy"], seen["t"] = np.asarray(noisy, np.float64), np.asarray(t)
        return jnp.zeros_like(noisy)

    objective = Objective(prediction_type=kind, snr_gamma=gamma)
    loss = diffusion_loss(denoiser, SCHED, objective, jnp.asarray(x0, jnp.float32), None, getkey())
    acp = SCHED.alphas_cumprod[seen["t"]].astype(np.float64).reshape(-1, 1, 1, 1)
    noise = (seen["noisy"] - np.sqrt(acp) * x0) / np.sqrt(1 - acp)
    goal = noise if kind == "epsilon" else np.sqrt(acp) * noise - np.sqrt(1 - acp) * x0
    per = np.mean(goal ** 2, axis=(1, 2, 3))
    r = acp.ravel() / (1 - acp.ravel())
    w = np.ones(4) if gamma is None else np.minimum(r, gamma) / (r if kind == "epsilon" else r + 1)
    np.testing.assert_allclose(float(loss), np.mean(per * w), rtol=1e-4)


def test_timestep_bias_weights_and_sampling(getkey):
    w = TimestepBias("later", multiplier=3.0, portion=0.25).weights(8)  # float64 NumPy: a division rounded once
    np.testing.assert_allclose(w, np.array([1, 1, 1, 1, 1, 1, 3, 3]) / 12)
    w = TimestepBias("range", multiplier=0.0, begin=2, end=6).weights(8)
    np.testing.assert_allclose(w, np.array([1, 1, 0, 0, 0, 0, 1, 1]) / 4)
    from eqxdiff.train import sample_timesteps

    t = np.asarray(sample_timesteps(getkey(), 4000, 1000, TimestepBias("earlier", multiplier=0.0, portion=0.5)))
    assert t.min() >= 500 and t.max() <= 999
    t = np.asarray(sample_timesteps(getkey(), 4000, 1000))
    assert t.min() < 50 and t.max() > 950


def test_noise_offset_adds_a_per_channel_constant(getkey):
    x = jnp.zeros((2, 5, 5, 3))
    key = getkey()
    plain, offset = offset_noise(key, x, 0.0), offset_noise(key, x, 0.5)
    diff = np.asarray(offset - plain)
    _, k_off = jax.random.split(key)
    constant = 0.5 * np.asarray(jax.random.normal(k_off, (2, 1, 1, 3)), np.float64)  # exact: 0.5 * a float32
    # (noise + c) - noise rounds twice at the noise's magnitude: NumPy's float32 does the same two roundings
    expected = (np.asarray(plain) + constant.astype(np.float32)) - np.asarray(plain)
    assert_close_to_float64(diff, expected, np.broadcast_to(constant, diff.shape), what="offset")
    assert_close_to_float64(diff[:, 0, 0, :], constant[:, 0, 0, :].astype(np.float32), constant[:, 0, 0, :],
                            what="the offset's draws")


def test_flow_matching_pair_by_hand():
    x0, noise = jnp.full((2, 1, 1, 1), 2.0), jnp.full((2, 1, 1, 1), -1.0)
    x_s, v = flow_matching_pair(x0, noise, jnp.asarray([0.0, 0.25]))
    # powers of two and their sums: every float32 operation here is exact, so is the result (on any CPU, FMA or not)
    np.testing.assert_allclose(np.ravel(x_s), [2.0, 0.75 * 2.0 - 0.25])
    np.testing.assert_allclose(np.ravel(v), [-3.0, -3.0])


# -- the train step --------------------------------------------------------------------------------------------
# Every single-device step below runs one compiled program: the same optimizer object (make_optimizer caches it per
# config), objective, batch shape and uncommitted inputs. Batches are pixels + token ids (encoded in the step), as a
# stream gives them; the cached-latent layout is checked against them by its loss.


def _state(model):
    optimizer = make_optimizer(OPT)
    state, frozen = init_state(model, optimizer, key=jax.random.key(1), ema=True)
    return state, frozen, optimizer


def _batch(arrays):
    return {k: jnp.asarray(v[:8]) for k, v in arrays.items()}


@eqx.filter_jit
def _loss(params, frozen, batch, key):
    return batch_loss(params, frozen, batch, key, scheduler=SCHED, objective=OBJECTIVE)


def test_cached_latents_give_the_same_loss(tiny, single_device_steps):
    """``cache_arrays`` stores the VAE posterior and the text embeddings; the loss from them equals the loss the
    first train step computed from the pixels and token ids (same key: the same latent sample, timesteps, noise and
    caption dropout)."""
    model, _, cached = tiny
    state, frozen, _ = _state(model)
    (_, m1), _ = single_device_steps
    _, key = jax.random.split(state.key)  # the key train_step hands batch_loss
    # the same sample, timesteps, noise and dropout: as accurate as the step's own loss against its float64 run
    (_, m1_64), _ = single_device_steps_float64(tiny)
    assert_close_to_float64(_loss(state.params, frozen, _batch(cached), key), m1["loss"], m1_64["loss"],
                            what="cached-latent loss")
    assert set(cached) == {"latent_mean", "latent_std", "encoder_hidden_states"}
    assert cached["latent_mean"].shape == (32, 4, 4, 4) and np.all(cached["latent_std"] > 0)


def test_train_step_lowers_the_loss_and_changes_only_trainable_leaves(tiny):
    model, arrays, cached = tiny
    state, frozen, optimizer = _state(model)
    batch = _batch(arrays)
    before = float(_loss(state.params, frozen, _batch(cached), jax.random.key(7)))  # the layout compiled once
    start = state
    for _ in range(30):
        state, metrics = train_step(state, frozen, batch, optimizer=optimizer, **KW)
    assert float(_loss(state.params, frozen, _batch(cached), jax.random.key(7))) < 0.8 * before
    assert set(metrics) == {"loss", "grad_norm", "learning_rate"} and float(metrics["learning_rate"]) == 1.0
    assert int(state.step) == 30
    spec = trainable_filter(model)
    trained, frozen_part = eqx.partition(state.model(frozen), spec)
    initial, initial_frozen = eqx.partition(model, spec)
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(initial)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen_part), jax.tree.leaves(initial_frozen)))
    assert jax.tree.structure(state.params) == jax.tree.structure(start.params)
    ema_gap = max(float(jnp.max(jnp.abs(e - p))) for e, p in zip(jax.tree.leaves(state.ema),
                                                                  jax.tree.leaves(state.params)))
    assert ema_gap > 0  # the EMA trails the weights
    with_text = trainable_filter(model, train_text_encoder=True)
    assert any(jax.tree.leaves(with_text.text_encoder)) and not any(jax.tree.leaves(spec.text_encoder))
    assert not any(jax.tree.leaves(spec.vae))


def test_gradient_accumulation_updates_every_k_steps(tiny):
    model, arrays, _ = tiny
    state, frozen, optimizer = _state(model)
    batch = _batch(arrays)
    p0 = jax.tree.leaves(state.params)
    s1, _ = train_step(state, frozen, batch, optimizer=optimizer, **KW)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1.params), p0))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1.ema), p0))
    s2, _ = train_step(s1, frozen, batch, optimizer=optimizer, **KW)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s2.params), p0))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s2.ema), p0))


def test_checkpoints_resume_exactly(tiny, tmp_path):
    """6 steps straight == 3 steps, a checkpoint (half-way through an accumulation), a fresh state restored from it,
    3 more steps; the resumed run reuses the compiled step (a restored state must keep the jit signature)."""
    model, arrays, _ = tiny
    kw = dict(KW, log_every=1)

    state, frozen, optimizer = _state(model)
    straight_state, straight = fit(state, frozen, ArrayBatches(arrays, 8, seed=3), steps=6, optimizer=optimizer, **kw)

    state, frozen, optimizer = _state(model)
    ckpt = Checkpointer(tmp_path / "ckpt", every=3, keep=1)
    batches = ArrayBatches(arrays, 8, seed=3)
    _, first = fit(state, frozen, batches, steps=3, optimizer=optimizer, checkpointer=ckpt, **kw)
    ckpt.close()
    assert batches.position == 3

    fresh, frozen, optimizer = _state(model)
    ckpt = Checkpointer(tmp_path / "ckpt", every=3, keep=1)
    assert ckpt.all_steps() == [3]
    resumed_batches = ArrayBatches(arrays, 8, seed=3)
    restored = ckpt.restore(fresh, resumed_batches)
    assert int(restored.step) == 3 and resumed_batches.position == 3
    compiled = train_step._cached._cache_size()
    resumed_state, second = fit(restored, frozen, resumed_batches, steps=6, optimizer=optimizer, checkpointer=ckpt,
                                **kw)
    ckpt.close()
    assert train_step._cached._cache_size() == compiled  # no second compile on resume
    assert first + second == straight
    for a, b in zip(jax.tree.leaves(resumed_state), jax.tree.leaves(straight_state)):
        np.testing.assert_array_equal(_data(a), _data(b))
    assert Checkpointer(tmp_path / "ckpt", every=3, keep=1).all_steps() == [6]  # keep=1 dropped step 3


def _data(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _two_steps(model, arrays):
    state, frozen, optimizer = _state(model)
    batch = shard_batch({k: v[:8] for k, v in arrays.items()}, None)
    s1, m1 = train_step(state, frozen, batch, optimizer=optimizer, **KW)
    s2, m2 = train_step(s1, frozen, batch, optimizer=optimizer, **KW)
    return (s1, m1), (s2, m2)


@pytest.fixture(scope="module")
def single_device_steps(tiny):
    """Two single-device micro-steps (the first accumulates, the second updates) from the shared compiled step."""
    model, arrays, _ = tiny
    return _two_steps(model, arrays)


_FLOAT64_STEPS = {}


def single_device_steps_float64(tiny):
    """:func:`single_device_steps` in float64 (the same keys: the same draws), once: what the float32 steps'
    rounding is measured against. The step's own ``eqx.filter_jit`` compiles it once more, for float64."""
    if "steps" not in _FLOAT64_STEPS:
        model, arrays, _ = tiny
        _FLOAT64_STEPS["steps"] = run_float64(_two_steps, model, arrays, jit=False)
    return _FLOAT64_STEPS["steps"]


@pytest.mark.parametrize("mesh_config", [MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1), FSDP_DATA],
                         ids=["fsdp", "fsdp+data"])
def test_sharded_step_equals_single_device(tiny, single_device_steps, mesh_config):
    """Two micro-steps on a mesh of the 8 simulated devices (the batch over data x fsdp, params, optimizer state and
    EMA by the rules, the model's activation constraints from its Plan) equal one device: the loss, the gradients
    (the accumulated ones after the first step), and the updated params and EMA after the second; every array of the
    state keeps the sharding it started with."""
    model, arrays, _ = tiny
    (s1, m1), (s2, m2) = single_device_steps
    mesh = make_mesh(mesh_config)
    planned = with_plan(shard_params(model, mesh), Plan(mesh))
    state, frozen, optimizer = _state(planned)
    state, frozen, shardings = shard_state(state, frozen, mesh)
    batch = shard_batch({k: v[:8] for k, v in arrays.items()}, mesh)
    assert batch["pixel_values"].sharding.shard_shape(batch["pixel_values"].shape)[0] == 1
    p1, n1 = train_step(state, frozen, batch, optimizer=optimizer, shardings=shardings, **KW)
    p2, n2 = train_step(p1, frozen, batch, optimizer=optimizer, shardings=shardings, **KW)
    # each as accurate as one device's float32 steps are against the same two steps in float64
    (t1, k1), (t2, k2) = single_device_steps_float64(tiny)
    for got, want, want64 in ((n1, m1, k1), (n2, m2, k2)):
        for name in ("loss", "grad_norm"):
            assert_close_to_float64(got[name], want[name], want64[name], what=name)
    assert_leaves_close_to_float64(p1.opt_state.acc_grads, s1.opt_state.acc_grads, t1.opt_state.acc_grads,
                                   what="gradients")
    assert_leaves_close_to_float64(p2.params, s2.params, t2.params, what="updated params")
    assert_leaves_close_to_float64(p2.ema, s2.ema, t2.ema, what="updated EMA")
    assert_leaves_close_to_float64(p2.opt_state.inner_opt_state[1][0].mu, s2.opt_state.inner_opt_state[1][0].mu,
                                   t2.opt_state.inner_opt_state[1][0].mu, what="Adam's mu")
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p2.params), jax.tree.leaves(state.params)))
    # shardings: as the rules give, kept by the step, and some really split (over fsdp: 4 or 8 ways)
    for tree in (state, p1, p2):
        for x, want in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
            assert x.sharding.is_equivalent_to(want, x.ndim), (x.shape, x.sharding, want)
    params = jax.tree.leaves(p2.params)
    split = [x for x in params if not x.sharding.is_fully_replicated]
    assert len(split) > len(params) // 4
    assert all(x.addressable_shards[0].data.size * mesh.shape["fsdp"] == x.size for x in split)
    mu = jax.tree.leaves(p2.opt_state.inner_opt_state[1][0].mu)
    assert sum(not x.sharding.is_fully_replicated for x in mu) == len(split)


# -- train.run from every data source ---------------------------------------------------------------------------
# Every run steps with the program test_sharded_step_equals_single_device[fsdp+data] compiled (same model, mesh,
# plan, optimizer, objective and batch layout); the autoencoder stage is skipped by handing each run the same saved
# VAE (a resumed run reuses it the same way).

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255), "black": (0, 0, 0),
          "yellow": (255, 255, 0), "cyan": (0, 255, 255), "magenta": (255, 0, 255)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 8 solid-colour images, captioned ``a {colour} square``, as an image folder (.txt captions), a parquet
    file read by Hugging Face ``datasets`` (columns ``img``/``caption``) and TFRecord shards (features
    ``png``/``prompt``); and a saved autoencoder for the runs to reuse."""
    from PIL import Image

    from eqxdiff.data import write_tfrecord
    from eqxdiff.loading import save_pretrained
    from eqxdiff.train._setup import build_model

    root = tmp_path_factory.mktemp("sources")
    folder = root / "folder"
    folder.mkdir()
    pngs = []
    for i, (name, rgb) in enumerate(COLORS.items()):
        Image.new("RGB", (10 + i, 12), rgb).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"a {name} square")
        pngs.append(((folder / f"{name}.png").read_bytes(), f"a {name} square"))
    write_tfrecord(root / "a.tfrecord", pngs[:5], image_key="png", caption_key="prompt")
    write_tfrecord(root / "b.tfrecord", pngs[5:], image_key="png", caption_key="prompt")
    try:  # only the Hugging Face runs need `datasets` (the "data" extra); the other sources run without it
        import datasets
    except ImportError:
        parquet = None
    else:
        parquet = root / "data.parquet"
        ds = datasets.Dataset.from_dict({"img": [str(folder / f"{c}.png") for c in COLORS],
                                         "caption": [f"a {c} square" for c in COLORS]})
        ds.cast_column("img", datasets.Image()).to_parquet(str(parquet))
    model, _, _ = build_model(RUN)
    save_pretrained(model.vae, root / "autoencoder")
    return {"folder": folder, "parquet": parquet, "tfrecord": (str(root / "a.tfrecord"),
            str(root / "b.tfrecord")), "autoencoder": root / "autoencoder"}


def _run(sources, out, **changes):
    import shutil

    from eqxdiff.train import run

    if not (out / "autoencoder").exists():
        shutil.copytree(sources["autoencoder"], out / "autoencoder")
    return run(dataclasses.replace(RUN, output_dir=out, **changes))


def _check_run(out, result, steps, mesh_size=8):
    import json

    state, _, losses = result
    assert int(state.step) == steps and len(losses) >= 1 and all(np.isfinite(losses))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == steps and rows[-1]["loss"] == losses[-1]
    assert (out / "pipeline" / "model_index.json").is_file()
    scheduler = json.loads((out / "pipeline" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["clip_sample"] is False and scheduler["set_alpha_to_one"] is False  # what DDIM/DDPM would read
    params = jax.tree.leaves(state.params)
    assert all(len(x.sharding.device_set) == mesh_size for x in params)
    if mesh_size > 1:
        assert any(not x.sharding.is_fully_replicated for x in params)  # split over fsdp


def _captions(tok, ids):
    return sorted(tok.batch_decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("source", ["folder", "hf", "tfrecord"])
def test_run_from_each_source(sources, tmp_path, source):
    """The flags of each source select it (the first batch holds its images under their captions) and ``run``
    trains on it end to end on the mesh."""
    from eqxdiff.train import load_data

    if source == "hf" and sources["parquet"] is None:
        pytest.skip("Hugging Face datasets is not installed (pip install -e '.[data]')")
    changes = {"folder": dict(data=str(sources["folder"])),
               "hf": dict(hf_dataset=str(sources["parquet"]), image_column="img", caption_column="caption"),
               "tfrecord": dict(tfrecord=sources["tfrecord"], image_key="png", caption_key="prompt")}[source]
    tok = character_tokenizer(max_length=32)
    kind, ds = load_data(dataclasses.replace(RUN, **changes), tok)
    batch = next(iter(ds))
    assert kind == "stream" and batch["pixel_values"].shape == (8, 8, 8, 3)
    captions = [c.replace(" ", "") for c in tok.batch_decode(batch["input_ids"], skip_special_tokens=True)]
    assert sorted(captions) == sorted(f"a{c}square" for c in COLORS)
    for image, caption in zip(batch["pixel_values"], captions):
        color = np.array(COLORS[caption[1:-6]])  # the pipeline's float32 u / 127.5 - 1, rounded as NumPy's is
        assert_close_to_float64(image[0, 0], color.astype(np.float32) / np.float32(127.5) - np.float32(1),
                                color / 127.5 - 1, what=caption)
    _check_run(tmp_path, _run(sources, tmp_path, **changes), steps=1)


def test_run_synthetic_resumes_exactly(sources, tmp_path):
    """Synthetic data on one device (the program the single-device tests compiled): 2 steps straight == 1 step, a
    checkpoint, then a resumed run of 1 more (the grain iterator's position and the state come back from it)."""
    one = dict(data="synthetic", mesh=None)
    straight = _run(sources, tmp_path / "a", steps=2, **one)
    _check_run(tmp_path / "a", straight, steps=2, mesh_size=1)
    first = _run(sources, tmp_path / "b", steps=1, checkpoint_every=1, **one)
    second = _run(sources, tmp_path / "b", steps=2, checkpoint_every=1, **one)
    assert first[2] + second[2] == straight[2]
    for a, b in zip(jax.tree.leaves(second[0].params), jax.tree.leaves(straight[0].params)):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def sigterm_raises():
    """While the test runs, a SIGTERM that reaches the process's handler raises (instead of killing pytest): a loop
    that failed to catch it fails the test. The test's own handler is put back after it (checked by the tests)."""

    class Unhandled(Exception):
        pass

    def handler(signum, frame):
        raise Unhandled("SIGTERM was not caught by the loop")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_run_resumes_exactly(sources, tmp_path, monkeypatch, sigterm_raises,
                                                                 signum):
    """A real SIGINT (Ctrl-C) or SIGTERM (what Slurm or Kubernetes send before a kill) during step 1 of 2 (sent
    from the metrics logger) stops the run at the step boundary with a saved checkpoint (no checkpoint_every
    needed) and TrainingInterrupted; the same command resumes and ends where an uninterrupted run ends, loss for
    loss and weight for weight. The runs reuse the module's compiled step."""
    from eqxdiff.train._metrics import MetricsLogger

    one = dict(data="synthetic", mesh=None, steps=2)
    straight = _run(sources, tmp_path / "a", **one)
    log = MetricsLogger.log
    handler = signal.getsignal(signum)

    def log_then_interrupt(self, step, row):
        log(self, step, row)
        if step == 1:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(MetricsLogger, "log", log_then_interrupt)
    with pytest.raises(TrainingInterrupted, match="interrupted at step 1; checkpoint saved in") as stopped:
        _run(sources, tmp_path / "b", **one)
    assert stopped.value.step == 1 and (tmp_path / "b" / "checkpoints" / "1").is_dir()
    assert signal.getsignal(signum) is handler  # the handler was put back
    monkeypatch.setattr(MetricsLogger, "log", log)
    resumed = _run(sources, tmp_path / "b", **one)
    assert resumed[2] == straight[2][1:]
    for a, b in zip(jax.tree.leaves(resumed[0].params), jax.tree.leaves(straight[0].params)):
        np.testing.assert_array_equal(a, b)


def test_resume_with_another_architecture_refuses_before_restoring(sources, tmp_path):
    """A checkpoint of one architecture is not restored into another: the error lists the arrays and the settings
    that differ, and the run's saved config.json stays as it was."""
    from eqxdiff.train import CheckpointMismatchError

    one = dict(data="synthetic", mesh=None, steps=1, checkpoint_every=1)
    _run(sources, tmp_path, **one)
    saved = (tmp_path / "config.json").read_text()
    wider = dataclasses.replace(TINY, unet_channels=(16,))
    with pytest.raises(CheckpointMismatchError, match=r"(?s)checkpoint 1 in .* was written by a different model .*"
                       r"nothing was restored.\nSettings that differ from that run's config.json: "
                       r"architecture\.unet_channels: \[8\] -> \[16\]\nArrays that differ:.*"
                       r"conv_in\.bias: \[8\] float32 in the checkpoint, \[16\] float32 in this run"):
        _run(sources, tmp_path, architecture=wider, **dict(one, steps=2))
    assert (tmp_path / "config.json").read_text() == saved


def test_resume_with_another_autoencoder_refuses_before_reusing_it(sources, tmp_path):
    """OUTPUT_DIR/autoencoder is reused only by a run whose VAE settings are those of the run that trained it: a
    changed VAE architecture (or KL weight, autoencoder steps ...) is refused with the list of what differs, before
    anything is written (the run's config.json and the saved VAE stay as they were). Nothing compiles: the earlier
    run is its config.json and its autoencoder."""
    earlier = dataclasses.replace(RUN, output_dir=tmp_path, data="synthetic", mesh=None)
    shutil.copytree(sources["autoencoder"], tmp_path / "autoencoder")
    (tmp_path / "config.json").write_text(json.dumps(run_settings(earlier), indent=2))
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    wider = dataclasses.replace(TINY, vae_channels=(8, 16))
    with pytest.raises(CheckpointMismatchError, match=r"the autoencoder in .*autoencoder was trained with other "
                       r"settings than this run's; it was not reused and nothing was changed. Settings that differ "
                       r"from that run's config.json: architecture.vae_channels: \[8, 8\] -> \[8, 16\]; kl_weight: "
                       r"0.0001 -> 0.001. Run with that run's settings, use another output_dir, or delete "):
        run(dataclasses.replace(earlier, architecture=wider, kl_weight=1e-3, steps=2))
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


def test_a_signal_stops_the_autoencoder_stage_and_keeps_nothing(tiny, tmp_path, monkeypatch, sigterm_raises):
    """SIGTERM during the autoencoder stage (sent from the stage's log line of step 1 of 3) stops it at the step
    boundary: TrainingInterrupted says that nothing of the stage was kept and how to start again, no autoencoder
    folder is written, and the handlers are put back. (The stage's step is a stand-in: the stopping is the loop's,
    and nothing needs to compile.)"""
    model, arrays, _ = tiny
    log = train_setup.log_line

    def log_then_terminate(message):
        log(message)
        if message.startswith("autoencoder step 1/"):
            os.kill(os.getpid(), signal.SIGTERM)

    steps = []

    def stand_in_step(carry, images, key, optimizer, kl_weight):
        steps.append(images.shape)
        return carry, jnp.float32(0.5)

    monkeypatch.setattr(train_setup, "log_line", log_then_terminate)
    monkeypatch.setattr(autoencoder_module, "_vae_step", stand_in_step)
    config = dataclasses.replace(RUN, output_dir=tmp_path, autoencoder_steps=3, autoencoder_batch_size=8)
    with pytest.raises(TrainingInterrupted, match=r"^autoencoder stage interrupted at step 1 of 3; nothing of it was "
                       r"kept \(run the same command to train it again from the start\)$") as stopped:
        train_setup.autoencoder_stage(config, model, "arrays", arrays)
    assert stopped.value.step == 1 and stopped.value.checkpoint is None and steps == [(8, 8, 8, 3)]
    assert not (tmp_path / "autoencoder").exists()
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises


def test_fine_tune_the_shipped_digits_model(tmp_path):
    """``model="digits"``: the shipped pipeline (its scheduler config has ``variance_type: null``, which once crashed
    DDPMScheduler.from_config) fine-tuned for one step on synthetic images, exported, and the export loads with the
    trained weights. One compile of the digits UNet's step (cached latents: no VAE or text encoder in it)."""
    config = TrainConfig(model="digits", data="synthetic", resolution=16, batch_size=2, steps=1, mesh=None,
                         cache_stream=True, log_every=1, progress=False, output_dir=tmp_path,
                         optimizer=OptimizerConfig(total_steps=1))
    state, _, losses = run(config)
    assert int(state.step) == 1 and len(losses) == 1 and np.isfinite(losses[0])
    assert not list((tmp_path / "checkpoints").glob("*"))  # no checkpoint_every: none written
    exported = eqxdiff.load_pipeline(tmp_path / "pipeline")
    shipped = eqxdiff.load_pipeline("digits")
    assert type(exported) is type(shipped) and type(exported.scheduler) is type(shipped.scheduler)
    assert exported.scheduler.config == shipped.scheduler.config
    trained, original = exported.unet.conv_in.weight, shipped.unet.conv_in.weight
    assert trained.shape == original.shape and not np.array_equal(trained, original)
    np.testing.assert_array_equal(exported.vae.encoder.conv_in.weight, shipped.vae.encoder.conv_in.weight)


def test_run_resumes_on_the_mesh(sources, tmp_path):
    """A checkpoint of a sharded state restores onto the mesh: the resumed run continues at the saved step, from
    the grain iterator's saved position, with every array on the sharding a fresh run gives it."""
    tfrecord = dict(tfrecord=sources["tfrecord"], image_key="png", caption_key="prompt", checkpoint_every=1)
    first = _run(sources, tmp_path, **tfrecord)
    second = _run(sources, tmp_path, steps=2, **tfrecord)
    _check_run(tmp_path, second, steps=2)
    assert len(second[2]) == 1 and second[2][0] != first[2][0]
    for a, b in zip(jax.tree.leaves(second[0]), jax.tree.leaves(first[0])):
        assert a.sharding == b.sharding


def test_run_config_errors_name_the_flag(sources, tmp_path):
    from eqxdiff.parallel import Remat
    from eqxdiff.train import TrainConfig, load_data

    with pytest.raises(ValueError, match=r"give one data source, got data='synthetic' and hf_dataset='x'"):
        TrainConfig(data="synthetic", hf_dataset="x")
    with pytest.raises(ValueError, match=r"give one data source, got hf_dataset='x' and tfrecord=\('a',\)"):
        TrainConfig(hf_dataset="x", tfrecord=("a",))
    with pytest.raises(ValueError, match="fine-tuning needs training data: set one of data"):
        TrainConfig(model="some/model").source
    with pytest.raises(ValueError, match=r"caption_key='prompt' is for the tfrecord source.*'hf'; use caption_column"):
        TrainConfig(hf_dataset="x", caption_key="prompt")
    with pytest.raises(ValueError, match=r"image_column='img' is for an hf_dataset or an image folder.*'synthetic'"):
        TrainConfig(data="synthetic", image_column="img")
    with pytest.raises(ValueError, match="remat_names"):
        TrainConfig(remat=Remat.NAMED)
    tok = character_tokenizer(max_length=32)
    with pytest.raises(DataError, match=r"caption_column='prompt' is not a column of .*data\.parquet.*\['img', "
                                        r"'caption'\]"):
        load_data(dataclasses.replace(RUN, hf_dataset=str(sources["parquet"]), image_column="img",
                                      caption_column="prompt"), tok)
    with pytest.raises(DataError, match=r"no bytes feature caption_key='text'; its features are \['png', 'prompt'\]"):
        load_data(dataclasses.replace(RUN, tfrecord=sources["tfrecord"], image_key="png"), tok)
    with pytest.raises(DataError, match=r"not 'digits', 'synthetic' or an image folder; for a Hugging Face dataset.*"
                                        r"hf_dataset \(--hf-dataset\)"):
        load_data(dataclasses.replace(RUN, data=str(sources["parquet"])), tok)
    with pytest.raises(DataError, match=r"not 'digits', 'synthetic' or an image folder; for TFRecord files"):
        load_data(dataclasses.replace(RUN, data=sources["tfrecord"][0]), tok)
    with pytest.raises(DataError, match="has 8 samples, fewer than batch_size=16"):
        load_data(dataclasses.replace(RUN, data=str(sources["folder"]), batch_size=16), tok)
    with pytest.raises(DataError, match=r"batch_size=12 must be a multiple of 8: the mesh .* data x fsdp"):
        _run(sources, tmp_path, data="synthetic", batch_size=12)


# -- errors ----------------------------------------------------------------------------------------------------

def test_bad_data_and_settings_raise_before_training(tiny):
    _, arrays, _ = tiny
    with pytest.raises(DataError, match="the dataset is empty"):
        ArrayBatches({"pixel_values": np.zeros((0, 8, 8, 3))}, 4)
    with pytest.raises(DataError, match=r"batch_size=64 must be in \[1, dataset size 32\]"):
        ArrayBatches(arrays, 64)
    with pytest.raises(DataError, match="different lengths"):
        ArrayBatches({"a": np.zeros(3), "b": np.zeros(4)}, 1)
    with pytest.raises(DataError, match=r"floats in \[-1, 1\]"):
        check_batch({**arrays, "pixel_values": arrays["pixel_values"] * 255})
    with pytest.raises(DataError, match="channels-last"):
        check_batch({**arrays, "pixel_values": np.moveaxis(arrays["pixel_values"], -1, 1)})
    with pytest.raises(DataError, match=r"lacks \['input_ids'\]"):
        check_batch({"pixel_values": arrays["pixel_values"]})
    with pytest.raises(DataError, match="batch size 12 must be a multiple of the 8 devices"):
        shard_batch({k: v[:12] for k, v in arrays.items()}, data_parallel_mesh())
    batches = ArrayBatches(arrays, 4, seed=1)
    with pytest.raises(DataError, match="batch_size=8"):
        batches.set_state({"position": 2, "seed": 1, "batch_size": 8})
    with pytest.raises(ValueError, match="snr_gamma=-1"):
        Objective(snr_gamma=-1.0)
    with pytest.raises(ValueError, match="prediction_type='x0'"):
        Objective(prediction_type="x0")
    with pytest.raises(ValueError, match="strategy='middle'"):
        TimestepBias("middle")
    with pytest.raises(ValueError, match="schedule='step'"):
        OptimizerConfig(schedule="step")
    with pytest.raises(ValueError, match="accumulation_steps=0"):
        OptimizerConfig(accumulation_steps=0)


def test_array_batches_cover_each_epoch_and_resume():
    arrays = {"x": np.arange(10)}
    b = ArrayBatches(arrays, 3, seed=5)
    epoch = np.concatenate([next(b)["x"] for _ in range(3)])
    assert len(set(epoch.tolist())) == 9  # one permutation per epoch, the partial batch dropped
    later = [next(b)["x"].tolist() for _ in range(4)]
    again = ArrayBatches(arrays, 3, seed=5, position=3)
    assert [next(again)["x"].tolist() for _ in range(4)] == later
