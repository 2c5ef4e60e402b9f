"""Training throughput of a UNet train step, eqxdiff (one jitted step) against diffusers (PyTorch), same weights.

    python benchmarks/train_step.py                    # full-size SD 1.5 UNet, batch 1, 64x64x4 latents, float32
    python benchmarks/train_step.py --preset tiny      # a seconds-long smoke run
    python benchmarks/train_step.py --batch 8 --dtype bfloat16   # on an NVIDIA GPU

Both steps: epsilon-prediction MSE at a random timestep, backward, AdamW (lr 1e-5, weight decay 0.01, no clipping)
on every UNet parameter. eqxdiff runs ``eqxdiff.train.train_step`` with the state donated (updated in place, as
PyTorch's optimizer does); text embeddings are given (cached), as is the latent. The model FLOPs of a step come
from XLA's cost analysis of the compiled eqxdiff step and are used for both frameworks' TFLOP/s. To bound memory
(a full-size AdamW state is ~14 GB in each framework) PyTorch runs first and is freed before eqxdiff starts, so the
two are timed one after the other in the same process; the load average is printed, and on a GPU each framework's
peak device memory (for eqxdiff also XLA's own account of the compiled step, which leaves out the scratch the
autotuner takes while compiling and which the process peak counts).

PyTorch runs on CUDA when it sees a GPU (``--torch-device``). On a GPU float32 matmuls and convolutions use TF32 in
both frameworks unless ``--no-tf32``. ``--dtype bfloat16`` is pure bfloat16 in both, no mixed precision: diffusers'
model is converted with ``.to(torch.bfloat16)`` (not autocast), eqxdiff loads it with ``eqxdiff.load(folder,
dtype="bfloat16")``; weights, gradients, AdamW moments, latents and text embeddings are all bfloat16, and both
take the MSE loss in float32.
"""

import dataclasses
import gc
import os
import statistics
import tempfile
import time

import tyro

from _bench import compiled_bytes, gib, jax_peak_bytes, setup_frameworks, torch_peak_bytes, torch_sync
from _unet_configs import PRESETS, UNetBenchmarkArgs, is_sdxl


@dataclasses.dataclass(frozen=True)
class Args(UNetBenchmarkArgs):
    """Time a UNet train step (loss, backward, AdamW) in eqxdiff and in diffusers."""


def _median(fn, repeats) -> tuple[float, list[float]]:
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
    if is_sdxl(config):
        raise ValueError(f"--preset {args.preset}: train_step trains SD-style UNets (text states only); the SDXL "
                         "presets (pooled embedding and time ids) are for unet_step.py and controlnet_step.py")
    device, header = setup_frameworks(args.torch_device, args.tf32)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    jdt = jnp.dtype(args.dtype)
    print(f"{header}; preset={args.preset} batch={args.batch} dtype={args.dtype}")
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
    results, peaks = {}, {}

    if not args.skip_diffusers:
        ref = (ref.to(device) if torch_dtype == torch.float32 else ref.to(device=device, dtype=torch_dtype)
               ).train()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, weight_decay=0.01)
        noise_sched = diffusers.DDPMScheduler(**sched_config)
        x0 = torch.from_numpy(latents).to(device=device, dtype=torch_dtype)
        ctx = torch.from_numpy(text).to(device=device, dtype=torch_dtype)
        gen = torch.Generator(device=device).manual_seed(0)

        def torch_step():
            noise = torch.randn(x0.shape, generator=gen, device=device, dtype=torch_dtype)
            t = torch.randint(0, 1000, (args.batch,), generator=gen, device=device)
            pred = ref(noise_sched.add_noise(x0, noise, t), t, ctx).sample
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch_sync(device)

        results["diffusers"] = _median(torch_step, args.repeats)
        peaks["diffusers"] = torch_peak_bytes(device)
        del opt, ref, torch_step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the cached blocks back, for JAX

    unet = eqxdiff.load(folder.name, dtype=args.dtype)
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
        return {"latent_mean": jnp.asarray(np.moveaxis(latents, 1, -1), jdt),
                "latent_std": jnp.zeros((args.batch, side, side, 4), jdt),
                "encoder_hidden_states": jnp.asarray(text, jdt)}

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
    peaks["eqxdiff"] = jax_peak_bytes()
    if peaks["eqxdiff"] is not None and compiled_bytes(compiled) is not None:
        print(f"eqxdiff: XLA's account of the compiled step: {gib(compiled_bytes(compiled))} (state, batch, "
              f"temporaries); the process peak below also counts the GPU autotuner's scratch while compiling")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, (med, times) in results.items():
        tf = "" if flops is None else f", {flops / med / 1e12:.4f} TFLOP/s per device"
        peak = "" if peaks[name] is None else f"; peak device memory {gib(peaks[name])}"
        print(f"{name} train step: median {med:.3f}s (runs: {', '.join(f'{t:.3f}' for t in times)}); "
              f"{args.batch / med:.3f} samples/s{tf}{peak}")
    if len(results) == 2:
        print(f"ratio eqxdiff/diffusers step time: {results['eqxdiff'][0] / results['diffusers'][0]:.2f} "
              f"(throughput ratio {results['diffusers'][0] / results['eqxdiff'][0]:.2f}x)")


if __name__ == "__main__":
    main(tyro.cli(Args))
