"""The tiny digits-architecture run that tests/test_train.py steps directly and tests/test_train_run.py trains with
``train.run``: the same model, scheduler, objective, optimizer and mesh, so both compile one program."""

import numpy as np

from eqxdiff.parallel import MeshConfig
from eqxdiff.schedulers import DDPMScheduler
from eqxdiff.train import (
    DigitsArchitecture,
    Objective,
    OptimizerConfig,
    TrainConfig,
    cache_arrays,
)
from eqxdiff.train._digits import SD_NOISE_SCHEDULE

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


def tiny_model():
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
