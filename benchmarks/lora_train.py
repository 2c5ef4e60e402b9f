"""A LoRA training step, eqxdiff's trainer against diffusers + PEFT, same UNet weights, and the optimizer state each
keeps against a full fine-tune's.

    python benchmarks/lora_train.py                         # full-size SD 1.5 UNet, rank 4, batch 1, 64x64x4 latents
    python benchmarks/lora_train.py --preset sdxl-small     # SDXL reduced for the CPU (benchmarks/_unet_configs.py)
    python benchmarks/lora_train.py --preset tiny           # a seconds-long smoke run

Both steps are diffusers' ``train_text_to_image_lora.py`` step on cached inputs: rank-``--rank`` LoRA (alpha = rank)
on the UNet's attention projections (PEFT: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``; eqxdiff:
``LoraConfig(targets=("attention",))``, the layers whose weights carry the ``heads`` axis), every UNet weight frozen,
epsilon MSE at a random timestep, backward, AdamW (lr 1e-4, weight decay 0.01) on the adapters alone. eqxdiff runs
``eqxdiff.train.train_step`` jitted with the state donated, the adapters put in by ``eqxdiff.train.add_lora`` and
trained through ``lora_filter``, as ``eqxdiff-train --lora.rank`` does. Steps are timed in turns (one untimed warm-up
each), with each side's process CPU time; the optimizer state is counted in bytes (PyTorch's AdamW after the steps;
eqxdiff's state as trained, and a full fine-tune's of the same UNet from its shapes, nothing allocated). The host's CPU
model and ISA flags and the load average are printed: read the ratios with them.
"""

import dataclasses
import os
import tempfile

import tyro

from _bench import load_average, report_cpu_times, report_times, setup_frameworks, time_interleaved, torch_sync
from _unet_configs import PRESETS, UNetBenchmarkArgs, is_sdxl, make_inputs

PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # diffusers' train_text_to_image_lora.py


@dataclasses.dataclass(frozen=True)
class Args(UNetBenchmarkArgs):
    """Time a LoRA train step (loss, backward, AdamW on the adapters) in eqxdiff and in diffusers + PEFT."""

    rank: int = 4
    """The adapters' rank (alpha = rank)."""


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _diffusers(args, config, inputs, device):
    """diffusers' UNet with PEFT adapters: ``(step, optimizer state bytes, adapted layers, trained numbers)``."""
    import diffusers
    import torch
    from peft import LoraConfig as PeftLoraConfig

    from _unet_configs import torch_inputs

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**config)
    folder = tempfile.TemporaryDirectory()
    unet.save_pretrained(folder.name)
    unet.requires_grad_(False)
    unet.add_adapter(PeftLoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                    target_modules=PEFT_TARGETS))
    unet.to(device).train()
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    sched = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                    beta_schedule="scaled_linear")
    t_in = torch_inputs(inputs, device, torch.float32)
    b = args.batch
    x0, ctx = t_in["latents"], t_in["text"][b:]
    added = None if t_in["added_cond_kwargs"] is None else {k: v[b:] for k, v in t_in["added_cond_kwargs"].items()}
    gen = torch.Generator(device=device).manual_seed(0)

    def step():
        noise = torch.randn(x0.shape, generator=gen, device=device)
        t = torch.randint(0, 1000, (b,), generator=gen, device=device)
        pred = unet(sched.add_noise(x0, noise, t), t, ctx, added_cond_kwargs=added).sample
        torch.nn.functional.mse_loss(pred.float(), noise.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_sync(device)

    def state_bytes() -> int:
        return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

    layers = sum(1 for n, _ in unet.named_modules() if n.endswith(".lora_A"))
    return step, state_bytes, layers, sum(p.numel() for p in params), folder


def _eqxdiff(args, config, inputs, folder):
    """eqxdiff's trainer on the same weights: ``(step, optimizer state bytes, a full fine-tune's, adapted layers,
    trained numbers)``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqxdiff
    from eqxdiff import nn
    from eqxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig
    from eqxdiff.schedulers import DDPMScheduler
    from eqxdiff.train import (
        LatentDiffusion,
        LoraConfig,
        Objective,
        OptimizerConfig,
        SDXLLatentDiffusion,
        add_lora,
        host_init,
        init_state,
        lora_filter,
        make_optimizer,
        trainable_filter,
    )
    from eqxdiff.train._step import train_step

    unet = eqxdiff.load(folder)
    vae = host_init(AutoencoderKL, AutoencoderKLConfig(block_out_channels=(8,), norm_num_groups=4,
                                                       scaling_factor=1.0))  # only scale_latents is used
    ids = jnp.zeros((1,), jnp.int32)
    b, side = args.batch, config["sample_size"]
    batch = {"latent_mean": jnp.asarray(np.moveaxis(inputs.latents, 1, -1)),
             "latent_std": jnp.zeros((b, side, side, 4)), "encoder_hidden_states": jnp.asarray(inputs.text[b:])}
    if is_sdxl(config):
        model = SDXLLatentDiffusion(unet=unet, text_encoder=None, text_encoder_2=None, vae=vae, null_input_ids=ids,
                                    null_input_ids_2=ids)
        image = 8 * side
        batch |= {"text_embeds": jnp.asarray(inputs.text_embeds[b:]),
                  "original_size": jnp.full((b, 2), image, jnp.int32), "crop_top_left": jnp.zeros((b, 2), jnp.int32)}
    else:
        model = LatentDiffusion(unet=unet, text_encoder=None, vae=vae, null_input_ids=ids)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-4, weight_decay=0.01, max_grad_norm=None,
                                               schedule="constant", total_steps=1000))
    full = eqx.filter(eqx.partition(model, trainable_filter(model))[0], eqx.is_array)
    full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(optimizer.init, full))
                     if x.ndim > 0)
    lora = LoraConfig(rank=args.rank, targets=("attention",))
    model = add_lora(model, lora, seed=0)
    layers = sum(s.layers or 1 for s in nn.adapter_sites(model.unet) if nn.resolve_site(model.unet, s).adapters)
    state, frozen = init_state(model, optimizer, key=jax.random.key(0), filter_spec=lora_filter(model))
    numbers = sum(x.size for x in jax.tree.leaves(eqx.filter(state.params, eqx.is_array)))
    del model, unet
    kwargs = dict(scheduler=DDPMScheduler.from_config(dict(num_train_timesteps=1000, beta_start=0.00085,
                                                           beta_end=0.012, beta_schedule="scaled_linear")),
                  objective=Objective(prediction_type="epsilon"), optimizer=optimizer, ema_decay=0.0)
    step_fn = eqx.filter_jit(lambda frozen, state, batch: train_step.__wrapped__(state, frozen, batch, **kwargs),
                             donate="all-except-first")
    holder = [state]

    def step():
        new, metrics = step_fn(frozen, holder[0], batch)
        jax.block_until_ready(metrics["loss"])
        holder[0] = new

    def state_bytes() -> int:
        return sum(x.nbytes for x in jax.tree.leaves(holder[0].opt_state) if jnp.ndim(x) > 0)

    return step, state_bytes, full_bytes, layers, numbers


def main(args: Args) -> None:
    config = PRESETS[args.preset]
    device, header = setup_frameworks(args.torch_device, args.tf32)
    print(f"{header}; preset={args.preset} batch={args.batch} rank={args.rank} float32")
    inputs = make_inputs(config, args.batch, args.text_tokens)
    torch_step, torch_bytes, torch_layers, torch_numbers, folder = _diffusers(args, config, inputs, device)
    jax_step, jax_bytes, full_bytes, jax_layers, jax_numbers = _eqxdiff(args, config, inputs, folder.name)
    print(f"adapted layers: eqxdiff {jax_layers}, PEFT {torch_layers}; trained numbers: eqxdiff "
          f"{jax_numbers / 1e6:.2f}M, PEFT {torch_numbers / 1e6:.2f}M")
    if (jax_layers, jax_numbers) != (torch_layers, torch_numbers):  # else the two would time different things
        raise SystemExit("eqxdiff and PEFT adapt different layers; the step times would not compare")
    runners = {"eqxdiff": jax_step, "diffusers+peft": torch_step}
    if args.skip_diffusers:
        runners.pop("diffusers+peft")
    cpu: dict[str, list[float]] = {}
    times = time_interleaved(runners, args.repeats, cpu_times=cpu)  # the warm-up compiles eqxdiff's step
    med = report_times(times, "LoRA train step")
    report_cpu_times(cpu, "diffusers+peft" if "diffusers+peft" in cpu else "eqxdiff", times)
    if len(med) == 2:
        print(f"ratio diffusers+peft / eqxdiff step time: {med['diffusers+peft'] / med['eqxdiff']:.2f}x "
              "(above 1: eqxdiff faster)")
    print(f"optimizer state: eqxdiff LoRA {_mb(jax_bytes())}, diffusers+peft LoRA {_mb(torch_bytes())}, "
          f"eqxdiff full fine-tune {_mb(full_bytes)} ({full_bytes / jax_bytes():.0f}x the LoRA's)")
    print(f"{load_average()} (pid {os.getpid()})")


if __name__ == "__main__":
    main(tyro.cli(Args))
