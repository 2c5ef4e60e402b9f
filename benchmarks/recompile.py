"""Core v2's promise in figures: a pipeline's first call compiles, later calls that change only values do not.

    python benchmarks/recompile.py                      # the shipped digits model and a tiny Flux pipeline (CPU)
    python benchmarks/recompile.py --flux-preset dev --dtype bfloat16   # FLUX.1-dev at full size (a GPU)

For each pipeline: the first call, then one call per changed value (guidance, steps, guidance rescale, DDIM's eta,
image-to-image strength, Flux's step count and guidance ...), each with its wall time and the seconds JAX spent
compiling in it (JAX's own ``/jax/core/compile`` events, every program counted, and the number of programs). Before
core v2 each of these later calls recompiled the whole denoising loop.
"""

import dataclasses
import tempfile
import time
from typing import Literal

import tyro

from _bench import host_cpu, load_average


@dataclasses.dataclass(frozen=True)
class Args:
    """Time a pipeline's first call against later calls that change only values."""

    flux_preset: Literal["tiny", "dev", "schnell", "none"] = "tiny"
    """The Flux pipeline to sweep too (random weights built by diffusers); "none" skips Flux."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The Flux pipeline's weights and activations dtype."""


class Compiles:
    """Counts JAX's backend compiles and their seconds (a listener on JAX's monitoring events)."""

    def __init__(self):
        import jax

        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, duration, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.seconds += duration


def sweep(pipe, base: dict, changes: list[tuple[str, dict]], compiles: Compiles) -> list[tuple[str, float, float,
                                                                                                int]]:
    rows = []
    for label, change in [("first call", {}), *changes]:
        count, seconds, t0 = compiles.count, compiles.seconds, time.perf_counter()
        pipe(**{**base, **change}, progress=False)
        rows.append((label, time.perf_counter() - t0, compiles.seconds - seconds, compiles.count - count))
    return rows


def print_table(title: str, rows) -> None:
    print(f"\n{title}\n| call | wall | compiling | programs compiled |\n| --- | ---: | ---: | ---: |")
    for label, wall, compiling, count in rows:
        print(f"| {label} | {wall:.2f} s | {compiling:.2f} s | {count} |")


def digits(compiles: Compiles) -> None:
    import numpy as np

    import eqxdiff

    pipe = eqxdiff.load_pipeline("digits")
    base = dict(prompt="a handwritten digit seven", num_inference_steps=8, guidance_scale=4.0, seed=0)
    print_table("digits model (DPM-Solver++), 16x16", sweep(pipe, base, [
        ("guidance_scale 4 -> 6.5", dict(guidance_scale=6.5)),
        ("num_inference_steps 8 -> 13", dict(num_inference_steps=13)),
        ("num_inference_steps 8 -> 30", dict(num_inference_steps=30)),
        ("guidance_rescale 0 -> 0.4", dict(guidance_rescale=0.4)),
        ("seed 0 -> 1", dict(seed=1)),
    ], compiles))
    ddim = pipe.with_scheduler("ddim")
    print_table("digits model, DDIM", sweep(ddim, base, [
        ("eta 0 -> 0.6", dict(eta=0.6)), ("num_inference_steps 8 -> 20", dict(num_inference_steps=20)),
    ], compiles))
    image = pipe(**base, progress=False)
    print_table("digits model, image-to-image", sweep(pipe, dict(base, image=np.asarray(image), strength=0.5), [
        ("strength 0.5 -> 0.8", dict(strength=0.8)), ("num_inference_steps 8 -> 13", dict(num_inference_steps=13)),
    ], compiles))


def flux(args: Args, compiles: Compiles) -> None:
    import torch

    import eqxdiff
    from _flux_configs import PRESETS, build_pipeline

    preset = PRESETS[args.flux_preset]
    on_gpu = torch.cuda.is_available()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    ref, _ = build_pipeline(preset, torch.device("cuda" if on_gpu else "cpu"), dtype)
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder, safe_serialization=True)
        del ref
        pipe = eqxdiff.load_pipeline(folder, dtype=args.dtype, scan_layers=True)
    base = dict(prompt="a red fox", height=preset.height, width=preset.width, num_inference_steps=preset.steps,
                guidance_scale=preset.guidance_scale or 0.0, max_sequence_length=preset.max_sequence_length, seed=0)
    steps = preset.steps
    print_table(f"Flux ({args.flux_preset}, {preset.height}x{preset.width}, {args.dtype})", sweep(pipe, base, [
        (f"num_inference_steps {steps} -> {steps + 5}", dict(num_inference_steps=steps + 5)),
        (f"num_inference_steps {steps} -> {max(1, steps - 2)}", dict(num_inference_steps=max(1, steps - 2))),
        ("guidance_scale -> 5.0", dict(guidance_scale=5.0)),
        ("sigmas (a custom schedule of 3)", dict(sigmas=[1.0, 0.6, 0.3])),
        ("seed 0 -> 1", dict(seed=1)),
    ], compiles))


def main(args: Args) -> None:
    import jax

    compiles = Compiles()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; host CPU {host_cpu()}; {load_average()}")
    digits(compiles)
    if args.flux_preset != "none":
        flux(args, compiles)


if __name__ == "__main__":
    main(tyro.cli(Args))
