"""eqxdiff.train: objectives against hand-computed values, the train step, accumulation, checkpoints that resume
exactly (without recompiling), FSDP and FSDP + data meshes of the 8 simulated CPU devices equal to one device, and
the errors of its parts (``train.run`` end to end: tests/test_train_run.py)."""

import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.parallel import MeshConfig, Plan, make_mesh, shard_params, with_plan
from eqxdiff.train import (
    ArrayBatches,
    Checkpointer,
    DataError,
    FluxFlowMatching,
    LatentDiffusion,
    Objective,
    OptimizerConfig,
    SDXLLatentDiffusion,
    TimestepBias,
    WanFlowMatching,
    batch_loss,
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
from eqxdiff.train._step import ema_decay_at

from ._tiny_train import FSDP_DATA, KW, OBJECTIVE, OPT, SCHED, tiny_model
from ._util import assert_close_to_float64, assert_leaves_close_to_float64, run_float64


@pytest.fixture(scope="module")
def tiny():
    """:func:`tests._tiny_train.tiny_model`: RUN's model, its samples, and the samples encoded."""
    return tiny_model()


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


def test_min_snr_on_a_zero_terminal_snr_schedule_names_the_cause(getkey):
    """Min-SNR of epsilon prediction on a zero-terminal-SNR schedule divides by an SNR of 0 at the last timestep (a
    NaN loss, which the loop blamed on the learning rate): refused up front, naming the cause and the fixes;
    v-prediction's weight there is 0, and its loss finite."""
    sched = type(SCHED).from_config(SCHED.config.to_dict(), rescale_betas_zero_snr=True)
    assert float(sched.alphas_cumprod[-1]) == 0.0
    x = jnp.ones((2, 4, 4, 4))
    with pytest.raises(ValueError, match=r"^snr_gamma \(Min-SNR weighting\) with prediction_type='epsilon' divides by "
                                         r"the SNR, which is 0 at the last timestep .*rescale_betas_zero_snr=True.*"
                                         r"prediction_type='v_prediction'.*or set snr_gamma=None$"):
        diffusion_loss(lambda x, t, c: x, sched, Objective(prediction_type="epsilon", snr_gamma=5.0), x, None,
                       getkey())
    last = jnp.asarray([999])
    assert float(min_snr_weights(snr(sched.alphas_cumprod, last), 5.0, "v_prediction")[0]) == 0.0
    loss = diffusion_loss(lambda x, t, c: x, sched, Objective(prediction_type="v_prediction", snr_gamma=5.0), x,
                          None, getkey())
    assert np.isfinite(float(loss))
    from eqxdiff.train._loop import _check_finite

    _check_finite(1.5, 3)
    with pytest.raises(FloatingPointError, match=r"^loss became nan at step 3: the weights diverged or a loss term "
                                                 r"is not finite; lower the learning rate"):
        _check_finite(float("nan"), 3)


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


@pytest.mark.parametrize("shape", [(2, 5, 5, 3), (2, 4, 5, 5, 3)], ids=["image", "video"])
def test_noise_offset_adds_a_per_channel_constant(getkey, shape):
    """diffusers' ``noise_offset * randn(b, c, 1, 1)``: one constant per sample and channel, the same over space
    and, for video latents ``[b, f, h, w, c]``, over frames (those were refused by the image-only signature)."""
    x = jnp.zeros(shape)
    key = getkey()
    plain, offset = offset_noise(key, x, 0.0), offset_noise(key, x, 0.5)
    diff = np.asarray(offset - plain)
    _, k_off = jax.random.split(key)
    per = (shape[0],) + (1,) * (len(shape) - 2) + (shape[-1],)
    constant = 0.5 * np.asarray(jax.random.normal(k_off, per), np.float64)  # exact: 0.5 * a float32
    # (noise + c) - noise rounds twice at the noise's magnitude: NumPy's float32 does the same two roundings
    expected = (np.asarray(plain) + constant.astype(np.float32)) - np.asarray(plain)
    assert_close_to_float64(diff, expected, np.broadcast_to(constant, diff.shape), what="offset")
    first = (slice(None),) + (0,) * (len(shape) - 2)
    assert_close_to_float64(diff[first], constant[first].astype(np.float32), constant[first],
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
    # the first optimizer update's EMA is the updated weights (diffusers' EMAModel: decay 0 at its first step)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s2.ema), jax.tree.leaves(s2.params)))


def test_ema_decay_is_diffusers_ema_model():
    """``ema_decay_at`` is diffusers' ``EMAModel`` decay at each of its steps (0 at the first: a copy; then
    ``(1 + s) / (10 + s)`` capped at ``decay``), and the EMA it gives over a few updates is ``EMAModel``'s."""
    import torch
    from diffusers.training_utils import EMAModel

    values = np.random.default_rng(0).standard_normal((12, 3)).astype(np.float32)
    for decay in (0.9999, 0.5):  # 0.5 caps from the 9th update
        param = torch.nn.Parameter(torch.zeros(3))
        reference = EMAModel([param], decay=decay)
        ema = np.zeros(3, np.float32)
        for update, value in enumerate(values, start=1):
            with torch.no_grad():
                param.copy_(torch.from_numpy(value))
            reference.step([param])
            d = float(ema_decay_at(jnp.asarray(update, jnp.int32), decay))
            assert abs(d - reference.cur_decay_value) <= 1e-6 * max(reference.cur_decay_value, 1e-30), (decay, update)
            ema = np.float32(d) * ema + np.float32(1 - d) * value
            np.testing.assert_allclose(ema, reference.shadow_params[0].numpy(), rtol=1e-5, atol=1e-6)


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


class _RecordingVAE:
    """Stands in for a VAE: records the statistics ``scale_latents`` is asked for."""

    def scale_latents(self, z, *, norm: str = "full"):
        self.norm = norm
        return z


@pytest.mark.parametrize("bundle, norm", [(LatentDiffusion, "scale"), (SDXLLatentDiffusion, "mean_std"),
                                          (FluxFlowMatching, "shift"), (WanFlowMatching, "full")])
def test_training_latents_use_the_statistics_the_family_pipeline_decodes_with(bundle, norm):
    """Training scales latents with the VAE statistics its family's pipeline unscales them with (diffusers' SD
    pipeline reads scaling_factor only, SDXL's latents_mean / latents_std, Flux's shift_factor; Wan's VAE all of its
    own): a model trained on one latent space samples in the same one."""
    vae = _RecordingVAE()
    fake = types.SimpleNamespace(vae=vae, pipeline_class=bundle.pipeline_class)
    zeros = jnp.zeros((1, 2, 2, 4))
    bundle.latents(fake, {"latent_mean": zeros, "latent_std": zeros}, jax.random.key(0))
    assert vae.norm == norm == (bundle.pipeline_class().LATENT_NORM or "full")
