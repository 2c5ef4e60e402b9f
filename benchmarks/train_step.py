"""Training throughput of a UNet train step, eqxdiff (one jitted step) against diffusers (PyTorch), same weights.

    python benchmarks/train_step.py                    # full-size SD 1.5 UNet, batch 1, 64x64x4 latents, float32
    python benchmarks/train_step.py --preset tiny      # a seconds-long smoke run

Both steps: epsilon-prediction MSE at a random timestep, backward, AdamW (lr 1e-5, weight decay 0.01, no clipping)
on every UNet parameter. eqxdiff runs ``eqxdiff.train.train_step`` with the state donated (updated in place, as
PyTorch's optimizer does); text embeddings are given (cached), as is the latent. The model FLOPs of a step come
from XLA's cost analysis of the compiled eqxdiff step and are used for both frameworks' TFLOP/s. To bound memory
(a full-size AdamW state is ~14 GB in each framework) PyTorch runs first and is freed before eqxdiff starts, so the
two are timed one after the other in the same process; the load average is printed.
"""

import dataclasses
import gc
import os
import statistics
import tempfile
import time
from typing import Literal

import tyro

PRESETS = {
    "sd15": dict(attention_head_dim=8, block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",), layers_per_block=2,
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, sample_size=64),
    "tiny": dict(attention_head_dim=2, block_out_channels=(32, 64), cross_attention_dim=32, norm_num_groups=8,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), layers_per_block=1,
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), sample_size=16),
}


@dataclasses.dataclass(frozen=True)
class Args:
    preset: Literal["sd15", "tiny"] = "sd15"
    """UNet config: the full-size Stable Diffusion 1.5 UNet, or a tiny one for a smoke run."""
    batch: int = 1
    """Samples per step."""
    repeats: int = 3
    """Timed steps per framework after one warm-up step; the median is reported."""
    text_tokens: int = 77
    skip_diffusers: bool = False


def _median(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main(args: Args) -> None:
    import diffusers
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import eqxdiff
    from eqxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig
    from eqxdiff.schedulers import DDPMScheduler
    from eqxdiff.train import LatentDiffusion, Objective, OptimizerConfig, host_init, init_state, make_optimizer
    from eqxdiff.train._metrics import step_flops
    from eqxdiff.train._step import train_step

    config = PRESETS[args.preset]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); preset={args.preset} batch={args.batch} float32")
    rng = np.random.default_rng(0)
    side = config["sample_size"]
    latents = rng.standard_normal((args.batch, 4, side, side), np.float32)
    text = rng.standard_normal((args.batch, args.text_tokens, config["cross_attention_dim"]), np.float32)
    sched_config = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")

    torch.manual_seed(0)
    ref = diffusers.UNet2DConditionModel(**config)
    folder = tempfile.TemporaryDirectory()
    ref.save_pretrained(folder.name)
    n_params = sum(p.numel() for p in ref.parameters())
    print(f"UNet: {n_params / 1e6:.0f}M parameters")
    results = {}

    if not args.skip_diffusers:
        ref.train()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, weight_decay=0.01)
        noise_sched = diffusers.DDPMScheduler(**sched_config)
        x0, ctx = torch.from_numpy(latents), torch.from_numpy(text)
        gen = torch.Generator().manual_seed(0)

        def torch_step():
            noise = torch.randn(x0.shape, generator=gen)
            t = torch.randint(0, 1000, (args.batch,), generator=gen)
            pred = ref(noise_sched.add_noise(x0, noise, t), t, ctx).sample
            loss = torch.nn.functional.mse_loss(pred, noise)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        results["diffusers"] = _median(torch_step, args.repeats)
        del opt, ref
        gc.collect()

    unet = eqxdiff.load(folder.name)
    vae = host_init(AutoencoderKL, AutoencoderKLConfig(block_out_channels=(8,), norm_num_groups=4,
                                                       scaling_factor=1.0))  # only scale_latents is used
    model = LatentDiffusion(unet=unet, text_encoder=None, vae=vae, null_input_ids=jnp.zeros((1,), jnp.int32))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-5, weight_decay=0.01, max_grad_norm=None,
                                               schedule="constant", total_steps=1000))
    state, frozen = init_state(model, optimizer, key=jax.random.key(0))
    del model, unet
    kwargs = dict(scheduler=DDPMScheduler.from_config(sched_config), objective=Objective(prediction_type="epsilon"),
                  optimizer=optimizer, ema_decay=0.0)
    donating = eqx.filter_jit(lambda frozen, state, batch: train_step.__wrapped__(state, frozen, batch, **kwargs),
                              donate="all-except-first")

    def batch():
        return {"latent_mean": jnp.asarray(np.moveaxis(latents, 1, -1)),
                "latent_std": jnp.zeros((args.batch, side, side, 4)), "encoder_hidden_states": jnp.asarray(text)}

    t0 = time.perf_counter()
    compiled = donating.lower(frozen, state, batch()).compile()
    flops = step_flops(compiled)
    print(f"eqxdiff compile: {time.perf_counter() - t0:.1f}s; XLA cost analysis: "
          f"{'n/a' if flops is None else f'{flops / 1e12:.3f} TFLOP'} per step")
    holder = [state]

    def jax_step():
        new, metrics = compiled(frozen, holder[0], batch())
        jax.block_until_ready(metrics["loss"])
        holder[0] = new

    results["eqxdiff"] = _median(jax_step, args.repeats)
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, (med, times) in results.items():
        tf = "" if flops is None else f", {flops / med / 1e12:.4f} TFLOP/s per device"
        print(f"{name} train step: median {med:.3f}s (runs: {', '.join(f'{t:.3f}' for t in times)}); "
              f"{args.batch / med:.3f} samples/s{tf}")
    if len(results) == 2:
        print(f"ratio eqxdiff/diffusers step time: {results['eqxdiff'][0] / results['diffusers'][0]:.2f} "
              f"(throughput ratio {results['diffusers'][0] / results['eqxdiff'][0]:.2f}x)")


if __name__ == "__main__":
    main(tyro.cli(Args))
