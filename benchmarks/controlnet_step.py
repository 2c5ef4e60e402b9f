"""ControlNet's overhead per classifier-free-guided step: ControlNet + UNet against the UNet alone, in eqxdiff and in
diffusers, all four timed in one run with the same random weights.

    python benchmarks/controlnet_step.py --preset sdxl-small      # the CPU's reduced SDXL (64x64 latents)
    python benchmarks/controlnet_step.py --preset sd15            # SD 1.5 UNet + its ControlNet
    python benchmarks/controlnet_step.py --preset sdxl-tiny       # a seconds-long smoke run (also --preset tiny)
    python benchmarks/controlnet_step.py --preset sdxl --dtype bfloat16 --repeats 20   # on a GPU: 1024x1024

The ControlNet is diffusers' ``ControlNetModel.from_unet(unet)`` (the UNet's encoder, as the SD and SDXL
ControlNets are; SDXL's keeps the 10-layer transformers), its zero-initialised convolutions given random weights;
the control image is 8x the latents' size (1024x1024x3 for SDXL), in [0, 1]. A step runs, as the ControlNet
pipelines do with guidance and no guess mode, the ControlNet and then the UNet on ``2 * batch`` latents and
combines the halves. Four variants take turns: each framework's UNet step and ControlNet + UNet step. Reported:
each median, the overhead ``(ControlNet + UNet) / UNet`` of each framework (how much slower a ControlNet step is,
the same run's medians), the ratio eqxdiff / diffusers of each step, and the outputs' agreement.
"""

import dataclasses
import statistics
import time

import tyro

from _bench import (check_agreement, fmt_seconds, gib, jax_peak_bytes, load_average, on_gpu, rel_error,
                    report_cpu_times, report_times, setup_frameworks, time_interleaved, torch_peak_bytes)
from _unet_configs import (CONTROL_FACTOR, PRESETS, UNetBenchmarkArgs, build_models, compile_jax_step, jax_inputs,
                           make_inputs, to_numpy_nhwc, torch_inputs, torch_step_runner)
from unet_step import check_attention


@dataclasses.dataclass(frozen=True)
class Args(UNetBenchmarkArgs):
    """Time a guided UNet step with and without a ControlNet, in eqxdiff and in diffusers."""

    guidance_scale: float = 7.5
    """Classifier-free guidance scale."""
    attention: str = "auto"
    """eqxdiff's attention implementation ("auto", or a name in eqxdiff.kernels.IMPLEMENTATIONS)."""
    tolerance: float | None = None
    """In float32: exit with an error if an eqxdiff output differs from diffusers' by more than this relative
    error; default: only print it."""


def main(args: Args) -> None:
    import jax.numpy as jnp
    import torch

    from eqxdiff.nn import with_attention_implementation

    check_attention([args.attention])
    device, header = setup_frameworks(args.torch_device, args.tf32)
    config = PRESETS[args.preset]
    print(f"{header}; preset={args.preset} dtype={args.dtype} UNet and ControlNet batch={2 * args.batch}")
    models = build_models(config, args.dtype, device, controlnet=True)
    inputs = make_inputs(config, args.batch, args.text_tokens, control_factor=CONTROL_FACTOR)
    j = jax_inputs(inputs, jnp.dtype(args.dtype))
    implementation = None if args.attention == "auto" else args.attention
    unet, controlnet = (with_attention_implementation(m, implementation) for m in (models.unet, models.controlnet))

    runners = {}
    for label, net in (("unet", None), ("controlnet+unet", controlnet)):
        t0 = time.perf_counter()
        runners[f"eqxdiff {label}"], _ = compile_jax_step(unet, net, j, args.guidance_scale, inputs.timestep)
        print(f"eqxdiff {label} [attention={args.attention}] compile: {time.perf_counter() - t0:.1f}s")
    if not args.skip_diffusers:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        t = torch_inputs(inputs, device, torch_dtype)
        for label, net in (("unet", None), ("controlnet+unet", models.ref_controlnet)):
            runners[f"diffusers {label}"] = torch_step_runner(models.ref_unet, net, t, args.guidance_scale,
                                                              inputs.timestep, device)

    outputs = {name: to_numpy_nhwc(run()) for name, run in runners.items()}  # the warm-up
    print(f"before timing: {load_average()}")
    cpu = {}
    times = time_interleaved(runners, args.repeats, warmup=0, cpu_times=cpu)
    print(f"after timing: {load_average()}")
    med = report_times(times)
    on_cpu = not on_gpu() and device.type == "cpu"
    if on_cpu:
        report_cpu_times(cpu, "diffusers unet", times)
    for name, peak in (("eqxdiff (both variants; the GPU autotuner's scratch too)", jax_peak_bytes()),
                       ("diffusers", None if args.skip_diffusers else torch_peak_bytes(device))):
        if peak is not None:
            print(f"peak device memory, {name}: {gib(peak)}")
    frameworks = ["eqxdiff"] + ([] if args.skip_diffusers else ["diffusers"])
    for fw in frameworks:
        base, with_cn = med[f"{fw} unet"], med[f"{fw} controlnet+unet"]
        line = (f"{fw}: ControlNet overhead per step {fmt_seconds(with_cn - base)} = (ControlNet + UNet) / UNet "
                f"{with_cn / base:.2f}")
        if on_cpu:
            cpu_ratio = statistics.median(cpu[f"{fw} controlnet+unet"]) / statistics.median(cpu[f"{fw} unet"])
            line += f" (in CPU time: {cpu_ratio:.2f})"
        print(line)
    if args.skip_diffusers:
        return
    errors = {}
    for label in ("unet", "controlnet+unet"):
        errors[label] = rel_error(outputs[f"eqxdiff {label}"], outputs[f"diffusers {label}"])
        print(f"ratio eqxdiff/diffusers, {label} step: {med[f'eqxdiff {label}'] / med[f'diffusers {label}']:.2f}"
              f"   (outputs agree to relative error {errors[label]:.1e})")
    effect = rel_error(outputs["diffusers controlnet+unet"], outputs["diffusers unet"])
    print(f"the ControlNet changes diffusers' output by relative {effect:.2f} (it is not idle)")
    check_agreement(errors, args.dtype, args.tolerance)


if __name__ == "__main__":
    main(tyro.cli(Args))
