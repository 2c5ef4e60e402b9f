"""Time one Flux transformer step, eqxdiff (jitted) against diffusers (PyTorch), same random weights, same run.

    python benchmarks/flux_step.py                        # the CPU's reduced FLUX.1-dev (1 + 2 blocks, 512x512)
    python benchmarks/flux_step.py --preset tiny          # a seconds-long smoke run (also --preset tiny-schnell)
    python benchmarks/flux_step.py --preset dev --dtype bfloat16 --attention auto cudnn flash --repeats 10   # GPU
    python benchmarks/flux_step.py --preset dev --dtype bfloat16 --fused --torch-compile                  # GPU

A step is one forward pass of ``FluxTransformer2DModel`` on the packed noisy latents of one ``height x width``
image (``preset``: 4096 image tokens at 1024x1024), T5 embeddings of ``text_tokens`` tokens, CLIP's pooled
embedding, a sigma and (dev) the distilled guidance 3.5: what each of a pipeline's 28 (dev) or 4 (schnell) steps
runs, batch 1. diffusers' model is built with PyTorch's default random initialisation directly on its device in
the benchmark's dtype and saved; eqxdiff loads that folder (``scan_layers``: the 19 + 38 blocks under
``lax.scan``, as the pipelines load it; ``--fused``: fused q/k/v and single-block projections). The rotary tables
are built once outside the step, as eqxdiff's pipeline does; diffusers' model builds them from the ids each call,
as its pipeline does. ``--torch-compile`` adds diffusers' transformer under ``torch.compile`` as another variant.

Prints each variant's median with its runs (after one untimed warm-up; the variants take turns), the load average,
the model FLOPs per step (analytic, see ``_flux_configs.py``; checked against XLA's count of the same step unrolled
with dense attention), TFLOP/s and, on a GPU, MFU (the device's dense bf16 peak), peak device memory of each
framework, the ratio eqxdiff / diffusers and the outputs' agreement.
"""

import dataclasses
import tempfile
import time
from typing import Literal

import tyro

from _bench import (TorchDevice, check_agreement, compile_variant, fmt_seconds, gib, jax_device_name, jax_peak_bytes,
                    load_average, mfu, on_gpu, rel_error, report_cpu_times, report_times, setup_frameworks, time_interleaved,
                    torch_free, torch_peak_bytes, torch_sync)
from _flux_configs import PRESETS, build_transformer, parameters, transformer_flops
from unet_step import check_attention

FluxPresetName = Literal["dev", "schnell", "reduced", "tiny", "tiny-schnell"]


@dataclasses.dataclass(frozen=True)
class Args:
    """Time one Flux transformer step in eqxdiff and in diffusers."""

    preset: FluxPresetName = "reduced"
    """"dev" / "schnell": FLUX.1 at full size, 1024x1024 (GPU); "reduced": FLUX.1-dev's widths with 1 double and 2
    single blocks at 512x512 (the CPU's config); "tiny" / "tiny-schnell": smoke runs."""
    batch: int = 1
    """Images per step."""
    repeats: int = 3
    """Timed steps per variant (after one untimed warm-up step); the median is reported."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both frameworks."""
    text_tokens: int | None = None
    """T5 sequence length (default: the preset's max_sequence_length, 512 for dev, 256 for schnell)."""
    attention: tuple[str, ...] = ("auto",)
    """eqxdiff attention implementation(s), each compiled separately ("auto", or names in
    eqxdiff.kernels.IMPLEMENTATIONS: "xla", "chunked", "cudnn", "flash")."""
    fused: bool = False
    """Load eqxdiff's transformer with fused projections (fused_projections=True)."""
    scan_layers: bool = True
    """eqxdiff's repeated blocks under lax.scan (as its pipelines load them); --no-scan-layers: unrolled."""
    torch_compile: bool = False
    """Also time diffusers' transformer under torch.compile (compiled during the warm-up)."""
    skip_diffusers: bool = False
    """Time eqxdiff only."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls in TF32 in both frameworks; --no-tf32: full float32 in both."""
    tolerance: float | None = None
    """In float32: exit with an error if an eqxdiff output differs from diffusers' by more than this relative
    error; default: only print it."""


def xla_unrolled_flops(config, grid: tuple[int, int], text_tokens: int, batch: int, dtype) -> float | None:
    """XLA's FLOP count of the step (``grid``: the packed image tokens' rows and columns) with the blocks unrolled and
    dense ("xla") attention, from the lowered HLO: no compile and no weights (the model and inputs are abstract).
    Scanned layers and chunked attention run in loops whose bodies XLA's cost analysis counts once, so only this
    form gives XLA's full count."""
    import equinox as eqx
    import jax

    from eqxdiff.models.flux import FluxTransformer2DModel, image_ids, text_ids
    from eqxdiff.nn import with_attention_implementation
    from eqxdiff.train import step_flops

    model = eqx.filter_eval_shape(FluxTransformer2DModel, config, dtype=dtype, key=jax.random.key(0))
    model = with_attention_implementation(model, "xla")
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    rope = model.rotary_embedding(image_ids(*grid), text_ids(text_tokens))
    sds = jax.ShapeDtypeStruct
    args = (sds((batch, grid[0] * grid[1], config.in_channels), dtype),
            sds((batch, text_tokens, config.joint_attention_dim), dtype),
            sds((batch, config.pooled_projection_dim), dtype), sds((batch,), dtype),
            sds((batch,), dtype) if config.guidance_embeds else None, jax.tree.map(lambda a: sds(a.shape, a.dtype), rope))

    def step(params, *a):
        return _call(eqx.combine(params, static), *a)

    return step_flops(jax.jit(step).lower(params, *args))


def _call(model, tokens, embeds, pooled, sigma, guidance, rope):
    return model(tokens, embeds, pooled, sigma, rope=rope, guidance=guidance)


def main(args: Args) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import eqxdiff
    from eqxdiff.models import flux
    from eqxdiff.nn import with_attention_implementation

    check_attention(args.attention)
    device, header = setup_frameworks(args.torch_device, args.tf32)
    preset = PRESETS[args.preset]
    text_tokens = args.text_tokens or preset.max_sequence_length
    h, w, c = preset.latent_shape
    n_img = preset.image_tokens
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    jdt = jnp.dtype(args.dtype)
    print(f"{header}; preset={args.preset} ({preset.height}x{preset.width}: {n_img} image + {text_tokens} text "
          f"tokens) dtype={args.dtype} batch={args.batch} fused={args.fused} scan_layers={args.scan_layers}")

    t0 = time.perf_counter()
    ref = build_transformer(preset, device, torch_dtype)
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder)
        model = eqxdiff.load(folder, dtype=args.dtype, scan_layers=args.scan_layers,
                             config_overrides={"fused_projections": args.fused})
    print(f"built, saved and loaded the transformer in {time.perf_counter() - t0:.1f}s "
          f"({parameters(ref) / 1e6:,.1f}M parameters)")
    if args.skip_diffusers:
        del ref
        torch_free(device)

    rng = np.random.default_rng(0)
    latents = rng.standard_normal((args.batch, h, w, c), np.float32)
    tokens = np.asarray(flux.pack_latents(jnp.asarray(latents)))
    cfg = preset.transformer
    embeds = rng.standard_normal((args.batch, text_tokens, cfg["joint_attention_dim"]), np.float32)
    pooled = rng.standard_normal((args.batch, cfg["pooled_projection_dim"]), np.float32)
    sigma = np.full((args.batch,), 0.75, np.float32)
    guidance = None if preset.guidance_scale is None else np.full((args.batch,), preset.guidance_scale, np.float32)
    img_ids, txt_ids = flux.image_ids(h // 2, w // 2), flux.text_ids(text_tokens)
    rope = jax.tree.map(jnp.asarray, model.rotary_embedding(img_ids, txt_ids))
    j_args = (jnp.asarray(tokens, jdt), jnp.asarray(embeds, jdt), jnp.asarray(pooled, jdt), jnp.asarray(sigma, jdt),
              None if guidance is None else jnp.asarray(guidance, jdt), rope)

    flops = transformer_flops(cfg, n_img, text_tokens, args.batch)
    counted = xla_unrolled_flops(model.config, (h // 2, w // 2), text_tokens, args.batch, jdt)
    print(f"model FLOPs per step: {flops / 1e12:.4g} TFLOP (analytic, matmuls only)"
          + ("" if counted is None else f"; XLA's count of the unrolled step: {counted / 1e12:.4g} TFLOP "
                                        f"({counted / flops:.3f}x)"))

    runners, labels = {}, []
    for name in args.attention:
        variant = with_attention_implementation(model, None if name == "auto" else name)
        params, static = eqx.partition(variant, eqx.is_array)

        def step(params, *a, static=static):
            return _call(eqx.combine(params, static), *a)

        label = f"eqxdiff [attention={name}{', fused' if args.fused else ''}]"
        if (compiled := compile_variant(label, step, params, *j_args)) is None:
            continue
        runners[label] = (lambda compiled=compiled, params=params:
                          jax.block_until_ready(compiled(params, *j_args)))
        labels.append(label)

    if not args.skip_diffusers:
        def t(a):
            return None if a is None else torch.from_numpy(np.array(a)).to(device=device, dtype=torch_dtype)

        t_kwargs = dict(hidden_states=t(tokens), encoder_hidden_states=t(embeds), pooled_projections=t(pooled),
                        timestep=t(sigma), guidance=t(guidance),
                        img_ids=torch.from_numpy(img_ids).to(device), txt_ids=torch.from_numpy(txt_ids).to(device))

        def torch_runner(module):
            def run():
                with torch.no_grad():
                    out = module(**t_kwargs, return_dict=False)[0]
                torch_sync(device)
                return out
            return run

        runners["diffusers"] = torch_runner(ref)
        if args.torch_compile:
            runners["diffusers (torch.compile)"] = torch_runner(torch.compile(ref))

    outputs = {}
    for name, run in runners.items():  # the warm-up (torch.compile compiles here)
        t0 = time.perf_counter()
        out = run()
        outputs[name] = np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, np.float32)
        print(f"{name} first call: {time.perf_counter() - t0:.1f}s")
    print(f"before timing: {load_average()}")
    cpu = {}
    times = time_interleaved(runners, args.repeats, warmup=0, cpu_times=cpu)
    print(f"after timing: {load_average()}")
    med = report_times(times)
    if not on_gpu() and device.type == "cpu":
        report_cpu_times(cpu, "diffusers", times)
    device_name = jax_device_name()
    for name, m in med.items():
        u = mfu(flops, m, device_name)
        print(f"{name}: {flops / m / 1e12:.3g} TFLOP/s" + ("" if u is None else f", MFU {100 * u:.1f}% of the "
                                                                               f"{device_name}'s dense bf16 peak"))
    for name, peak in (("eqxdiff (the GPU autotuner's scratch while compiling too)", jax_peak_bytes()),
                       ("diffusers", None if args.skip_diffusers else torch_peak_bytes(device))):
        if peak is not None:
            print(f"peak device memory, {name}: {gib(peak)}")
    if args.skip_diffusers:
        return
    errors = {}
    for label in labels:
        errors[label] = rel_error(outputs[label], outputs["diffusers"])
        print(f"ratio {label}/diffusers: {med[label] / med['diffusers']:.2f} ({fmt_seconds(med[label])} vs "
              f"{fmt_seconds(med['diffusers'])})   (outputs agree to relative error {errors[label]:.1e})")
        if "diffusers (torch.compile)" in med:
            print(f"ratio {label}/diffusers (torch.compile): {med[label] / med['diffusers (torch.compile)']:.2f}")
    check_agreement(errors, args.dtype, args.tolerance)


if __name__ == "__main__":
    main(tyro.cli(Args))
