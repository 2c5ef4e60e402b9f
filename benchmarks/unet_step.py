"""Time one classifier-free-guided UNet step, eqxdiff (jitted) against diffusers (PyTorch), same random weights.

    python benchmarks/unet_step.py                      # SD 1.5 UNet, UNet batch 2, 64x64x4 latents, float32
    python benchmarks/unet_step.py --preset sdxl-small  # SDXL reduced for the CPU (2 not 10 layers, 64x64 latents)
    python benchmarks/unet_step.py --repeats 5 --batch 2 --dtype bfloat16 --attention xla chunked
    python benchmarks/unet_step.py --preset tiny        # a seconds-long smoke run (also --preset sdxl-tiny)
    python benchmarks/unet_step.py --preset sdxl --dtype bfloat16 --attention auto cudnn flash --repeats 20  # GPU

A step runs the UNet on ``2 * batch`` latents (unconditional and conditional halves) with 77 text tokens and
combines them, ``u + s * (c - u)``; SDXL presets also pass the pooled text embedding and the six time ids
(``text_time``). diffusers' model is built with random weights and saved; eqxdiff loads that folder, so both run
the same weights. Prints the compile time, the median step time of each and their ratio, the load average before
and after, and on a GPU the peak device memory of each framework. PyTorch runs on CUDA when it sees a GPU
(``--torch-device``); on a GPU float32 matmuls use TF32 in both frameworks unless ``--no-tf32``. An attention
implementation that cannot serve this model (e.g. "cudnn" in float32) is reported as skipped and the others still
run. The issue-11 target: the full SDXL step (``--preset sdxl --dtype bfloat16``) at most 30 ms on an H100.
"""

import dataclasses
import time

import tyro

from _bench import (check_agreement, compiled_bytes, gib, jax_peak_bytes, load_average, on_gpu, rel_error,
                    report_cpu_times, report_times, setup_frameworks, time_interleaved, torch_peak_bytes)
from _unet_configs import (PRESETS, UNetBenchmarkArgs, build_models, compile_jax_step, jax_inputs, make_inputs,
                           to_numpy_nhwc, torch_inputs, torch_step_runner)


@dataclasses.dataclass(frozen=True)
class Args(UNetBenchmarkArgs):
    """Time a classifier-free-guided UNet step in eqxdiff and in diffusers."""

    guidance_scale: float = 7.5
    """Classifier-free guidance scale."""
    attention: tuple[str, ...] = ("auto",)
    """eqxdiff attention implementation(s) to time, each compiled separately ("auto": chosen per call for the
    platform; else a name in eqxdiff.kernels.IMPLEMENTATIONS: "xla", "chunked", "cudnn" (NVIDIA GPU, bfloat16),
    "flash" (Pallas: GPU or TPU))."""
    tolerance: float | None = None
    """In float32: exit with an error if an eqxdiff output differs from diffusers' by more than this relative
    error (max|a - b| / max|b|); default: only print it."""


def check_attention(names) -> None:
    from eqxdiff.kernels import IMPLEMENTATIONS

    unknown = [name for name in names if name != "auto" and name not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"--attention {' '.join(unknown)}: not an eqxdiff.kernels implementation; choose from "
                         f"{['auto', *IMPLEMENTATIONS]}")


def main(args: Args) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from eqxdiff.nn import with_attention_implementation

    check_attention(args.attention)
    device, header = setup_frameworks(args.torch_device, args.tf32)
    config = PRESETS[args.preset]
    print(f"{header}; preset={args.preset} dtype={args.dtype} UNet batch={2 * args.batch}")
    models = build_models(config, args.dtype, device)
    inputs = make_inputs(config, args.batch, args.text_tokens)
    j = jax_inputs(inputs, jnp.dtype(args.dtype))

    runners, compiled_names = {}, []
    for name in args.attention:
        unet = with_attention_implementation(models.unet, None if name == "auto" else name)
        t0 = time.perf_counter()
        try:
            run, compiled = compile_jax_step(unet, None, j, args.guidance_scale, inputs.timestep)
        except Exception as e:  # e.g. AttentionUnavailableError: the other implementations still run
            print(f"eqxdiff [attention={name}] skipped: {type(e).__name__}: {str(e).splitlines()[0][:500]}")
            continue
        need = compiled_bytes(compiled) if jax.devices()[0].platform != "cpu" else None
        print(f"eqxdiff [attention={name}] compile: {time.perf_counter() - t0:.1f}s"
              + ("" if need is None else f"; XLA's account of one step: {gib(need)} (weights, inputs, temporaries)"))
        runners[f"eqxdiff [attention={name}]"] = run
        compiled_names.append(name)
    if not args.skip_diffusers:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        runners["diffusers"] = torch_step_runner(models.ref_unet, None, torch_inputs(inputs, device, torch_dtype),
                                                 args.guidance_scale, inputs.timestep, device)

    # One warm-up each, then the variants take turns, so that a shared machine's load falls on all of them alike.
    outputs = {name: to_numpy_nhwc(run()) for name, run in runners.items()}
    print(f"before timing: {load_average()}")
    cpu = {}
    times = time_interleaved(runners, args.repeats, warmup=0, cpu_times=cpu)
    print(f"after timing: {load_average()}")
    med = report_times(times)
    if not on_gpu() and device.type == "cpu":
        report_cpu_times(cpu, "diffusers", times)
    peaks = {"eqxdiff (all attention variants, and the GPU autotuner's scratch while compiling)": jax_peak_bytes(),
             "diffusers": None if args.skip_diffusers else torch_peak_bytes(device)}
    for name, peak in peaks.items():
        if peak is not None:
            print(f"peak device memory, {name}: {gib(peak)}")
    if args.skip_diffusers:
        return
    errors = {}
    for name in compiled_names:
        label = f"eqxdiff [attention={name}]"
        errors[label] = rel_error(outputs[label], outputs["diffusers"])
        print(f"ratio eqxdiff/diffusers [attention={name}]: {med[label] / med['diffusers']:.2f}"
              f"   (outputs agree to relative error {errors[label]:.1e})")
    check_agreement(errors, args.dtype, args.tolerance)


if __name__ == "__main__":
    main(tyro.cli(Args))
