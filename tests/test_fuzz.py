"""Fuzzing the argument ranges of ``eqxdiff-generate`` and ``eqxdiff-train`` (hypothesis): whatever the values, the
check before loading (``validate``) either accepts them, and then what it accepts is usable, or raises a typed error
(``ValueError`` and its subclasses, ``OSError``). Nothing is loaded or compiled inside an example."""

import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eqxdiff.cli import generate, train
from eqxdiff.pipelines import InputWarning, seed_key

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values a user can type: edge ints, huge ints, floats with NaN/inf, and the ordinary ranges.
INTS = st.one_of(st.integers(-3, 70), st.sampled_from([-(2**63), -1, 0, 2**31, 2**64, 10**30]))
FLOATS = st.one_of(st.floats(-2.0, 12.0), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324]))
# Off by default: a flag is given only when the strategy draws a value.
MAYBE = {"int": st.none() | INTS, "float": st.none() | FLOATS}

GENERATE_FLAGS = {  # flag -> kind
    "--height": "int", "--width": "int", "--num-inference-steps": "int", "--num-images-per-prompt": "int",
    "--seed": "int", "--clip-skip": "int", "--guidance-scale": "float", "--guidance-rescale": "float",
    "--eta": "float", "--strength": "float",
}


def _argv(values: dict) -> list[str]:
    return [token for flag, v in values.items() if v is not None for token in (flag, repr(v) if isinstance(v, float)
                                                                              and not math.isfinite(v) else str(v))]


@FUZZ
@given(st.fixed_dictionaries({flag: MAYBE[kind] for flag, kind in GENERATE_FLAGS.items()}))
def test_generate_accepts_only_what_it_can_run(values):
    argv = _argv(values)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InputWarning)
            checked = generate.validate(argv)
    except (ValueError, OSError):
        return  # a typed error: the command prints one line and exits 2
    kw = checked.kwargs
    for name in ("height", "width"):  # the digits model: a multiple of its VAE's 4, or its native size
        assert kw[name] is None or (kw[name] > 0 and kw[name] % 4 == 0), kw[name]
    assert kw["num_inference_steps"] >= 1 and kw["num_images_per_prompt"] >= 1
    assert kw["num_inference_steps"] <= 1000  # the schedule is checked too: the scheduler's 1000 training timesteps
    assert 0.0 <= kw["guidance_scale"] <= 100.0 and 0.0 <= kw["guidance_rescale"] <= 1.0 and 0.0 <= kw["eta"] <= 1
    assert kw["clip_skip"] is None or 0 <= kw["clip_skip"] <= 2  # the digits text encoder has 2 layers
    assert kw["strength"] is None  # no --image: text-to-image takes no strength
    assert kw["seed"] is None or seed_key(kw["seed"]).shape == ()  # any int the flag took is a key


TRAIN_FLAGS = {
    "--resolution": "int", "--batch-size": "int", "--steps": "int", "--seed": "int", "--log-every": "int",
    "--checkpoint-every": "int", "--sample-steps": "int", "--autoencoder-steps": "int",
    "--optimizer.learning-rate": "float", "--optimizer.warmup-steps": "int", "--optimizer.beta2": "float",
    "--optimizer.eps": "float", "--optimizer.weight-decay": "float", "--optimizer.max-grad-norm": "float",
    "--optimizer.accumulation-steps": "int", "--optimizer.final-learning-rate-fraction": "float",
    "--objective.snr-gamma": "float", "--objective.noise-offset": "float", "--objective.caption-dropout": "float",
    "--objective.logit-std": "float", "--objective.timestep-bias.multiplier": "float",
    "--objective.timestep-bias.portion": "float", "--ema-decay": "float", "--kl-weight": "float",
    "--sample-guidance-scale": "float", "--architecture.image-size": "int", "--architecture.text-layers": "int",
    "--architecture.norm-num-groups": "int", "--mesh.ici-data-parallelism": "int",
}


@FUZZ
@given(st.fixed_dictionaries({flag: MAYBE[kind] for flag, kind in TRAIN_FLAGS.items()}))
def test_train_config_accepts_only_what_it_can_run(values):
    try:
        config = train.validate(["digits", *_argv(values)])
    except (ValueError, OSError):
        return
    opt, obj, arch = config.optimizer, config.objective, config.architecture
    assert config.resolution >= 1 and config.resolution % 2 ** (len(arch.vae_channels) - 1) == 0
    assert min(config.batch_size, config.steps, config.log_every, config.sample_steps, config.autoencoder_steps) >= 1
    assert 0 <= config.seed < 2**31 and config.checkpoint_every >= 0
    floats = [opt.learning_rate, opt.beta2, opt.eps, opt.weight_decay, opt.final_learning_rate_fraction,
              obj.noise_offset, obj.caption_dropout, obj.logit_std, obj.timestep_bias.multiplier,
              obj.timestep_bias.portion, config.kl_weight, config.sample_guidance_scale]
    floats += [x for x in (opt.max_grad_norm, obj.snr_gamma, config.ema_decay) if x is not None]
    assert all(math.isfinite(x) for x in floats), floats
    assert opt.learning_rate > 0 and opt.eps > 0 and 0 <= opt.beta2 < 1 and opt.accumulation_steps >= 1
    assert config.ema_decay is None or 0 < config.ema_decay < 1
    assert np.all(np.asarray(arch.vae_channels) % arch.norm_num_groups == 0) and arch.text_layers >= 1


@pytest.mark.parametrize("seed", [0, 2**32, -5])
def test_fuzzed_seed_strings_round_trip(seed):
    """A seed on the command line is the same int in the call (no float or overflow on the way)."""
    assert generate.validate(["--seed", str(seed)]).kwargs["seed"] == seed
