"""Time one classifier-free-guided UNet step, eqxdiff (jitted) against diffusers (PyTorch), same random weights.

    python benchmarks/unet_step.py                      # SD 1.5 UNet, UNet batch 2, 64x64x4 latents, float32
    python benchmarks/unet_step.py --repeats 5 --batch 2 --dtype bfloat16 --attention xla chunked
    python benchmarks/unet_step.py --preset tiny        # a seconds-long smoke run
    python benchmarks/unet_step.py --dtype bfloat16 --attention auto xla cudnn flash   # on an NVIDIA GPU

A step runs the UNet on ``2 * batch`` latents (unconditional and conditional halves) with 77 text tokens and
combines them, ``u + s * (c - u)``. diffusers' model is built with random weights and saved; eqxdiff loads that
folder, so both run the same weights. Prints the compile time, the median step time of each and their ratio, and on
a GPU the peak device memory of each framework. PyTorch runs on CUDA when it sees a GPU (``--torch-device``); on a
GPU float32 matmuls use TF32 in both frameworks unless ``--no-tf32``. An attention implementation that cannot
serve this model (e.g. "cudnn" in float32) is reported as skipped and the others still run.
"""

import dataclasses
import functools
import os
import statistics
import tempfile
import time

import tyro

from _unet_configs import (PRESETS, UNetBenchmarkArgs, compiled_bytes, gib, jax_peak_bytes, setup_frameworks,
                           torch_peak_bytes, torch_sync)


@dataclasses.dataclass(frozen=True)
class Args(UNetBenchmarkArgs):
    """Time a classifier-free-guided UNet step in eqxdiff and in diffusers."""

    guidance_scale: float = 7.5
    """Classifier-free guidance scale."""
    attention: tuple[str, ...] = ("auto",)
    """eqxdiff attention implementation(s) to time, each compiled separately ("auto": chosen per call for the
    platform; else a name in eqxdiff.kernels.IMPLEMENTATIONS: "xla", "chunked", "cudnn" (NVIDIA GPU, bfloat16),
    "flash" (Pallas: GPU or TPU))."""


def main(args: Args) -> None:
    import diffusers
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import eqxdiff
    from eqxdiff.kernels import IMPLEMENTATIONS
    from eqxdiff.nn import with_attention_implementation

    unknown = [name for name in args.attention if name != "auto" and name not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"--attention {' '.join(unknown)}: not an eqxdiff.kernels implementation; choose from "
                         f"{['auto', *IMPLEMENTATIONS]}")
    device, header = setup_frameworks(args.torch_device, args.tf32)
    config = PRESETS[args.preset]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    print(f"{header}; preset={args.preset} dtype={args.dtype} UNet batch={2 * args.batch}")

    t0 = time.perf_counter()
    torch.manual_seed(0)
    ref = diffusers.UNet2DConditionModel(**config).eval()
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder)
        unet = eqxdiff.load(folder, dtype=args.dtype)
    ref = ref.to(device) if torch_dtype == torch.float32 else ref.to(device=device, dtype=torch_dtype)
    print(f"built and loaded both models in {time.perf_counter() - t0:.1f}s "
          f"({sum(p.numel() for p in ref.parameters()) / 1e6:.0f}M parameters)")

    rng = np.random.default_rng(0)
    side, cin = config["sample_size"], 4
    latents = rng.standard_normal((args.batch, cin, side, side), np.float32)
    text = rng.standard_normal((2 * args.batch, args.text_tokens, config["cross_attention_dim"]), np.float32)
    timestep = 981

    # eqxdiff: weights are arguments (not constants) of one compiled step.
    def step(params, latents, t, text, scale, *, static):
        model = eqx.combine(params, static)
        eps = model(jnp.concatenate([latents, latents]), t, text)
        uncond, cond = jnp.split(eps, 2)
        return uncond + scale * (cond - uncond)

    jdt = jnp.dtype(args.dtype)
    j_inputs = (jnp.asarray(np.moveaxis(latents, 1, -1), jdt), jnp.asarray(timestep), jnp.asarray(text, jdt),
                jnp.asarray(args.guidance_scale, jdt))
    runners, outputs = {}, {}

    def jax_runner(compiled, params, name):
        def run():
            outputs[name] = np.asarray(jax.block_until_ready(compiled(params, *j_inputs)))
        return run

    compiled_names = []
    for name in args.attention:
        params, static = eqx.partition(with_attention_implementation(unet, None if name == "auto" else name),
                                       eqx.is_array)
        t0 = time.perf_counter()
        try:
            compiled = jax.jit(functools.partial(step, static=static)).lower(params, *j_inputs).compile()
        except Exception as e:  # e.g. AttentionUnavailableError: the other implementations still run
            print(f"eqxdiff [attention={name}] skipped: {type(e).__name__}: {str(e).splitlines()[0][:500]}")
            continue
        need = compiled_bytes(compiled) if jax.devices()[0].platform != "cpu" else None
        print(f"eqxdiff [attention={name}] compile: {time.perf_counter() - t0:.1f}s"
              + ("" if need is None else f"; XLA's account of one step: {gib(need)} (weights, inputs, temporaries)"))
        runners[f"eqxdiff [attention={name}]"] = jax_runner(compiled, params, name)
        compiled_names.append(name)

    if not args.skip_diffusers:
        t_latents = torch.from_numpy(latents).to(device=device, dtype=torch_dtype)
        t_text = torch.from_numpy(text).to(device=device, dtype=torch_dtype)

        def run_torch():
            with torch.no_grad():
                eps = ref(torch.cat([t_latents, t_latents]), timestep, t_text).sample
                uncond, cond = eps.chunk(2)
                outputs["diffusers"] = (uncond + args.guidance_scale * (cond - uncond)).float().cpu().numpy()
            torch_sync(device)

        runners["diffusers"] = run_torch

    # One warm-up each, then the variants take turns, so that a shared machine's load falls on all of them alike.
    times = {name: [] for name in runners}
    for name, run in runners.items():
        run()
    for _ in range(args.repeats):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name} step: median {med[name]:.3f}s  (runs: {', '.join(f'{t:.3f}' for t in ts)})")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    peaks = {"eqxdiff (all attention variants, and the GPU autotuner's scratch while compiling)": jax_peak_bytes(),
             "diffusers": None if args.skip_diffusers else torch_peak_bytes(device)}
    for name, peak in peaks.items():
        if peak is not None:
            print(f"peak device memory, {name}: {gib(peak)}")
    if args.skip_diffusers:
        return
    expected = np.moveaxis(outputs["diffusers"], 1, -1)
    for name in compiled_names:
        got = outputs[name].astype(np.float32)
        err = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
        print(f"ratio eqxdiff/diffusers [attention={name}]: {med[f'eqxdiff [attention={name}]'] / med['diffusers']:.2f}"
              f"   (outputs agree to relative error {err:.1e})")


if __name__ == "__main__":
    main(tyro.cli(Args))
