"""Flux end to end, eqxdiff's ``FluxPipeline`` against diffusers' in the same run, from one random-weight folder.

    python benchmarks/flux_pipeline.py --preset tiny        # a smoke run on the CPU (seconds; also tiny-schnell)
    python benchmarks/flux_pipeline.py --preset dev --dtype bfloat16 --repeats 3       # GPU: FLUX.1-dev, 28 steps
    python benchmarks/flux_pipeline.py --preset schnell --dtype bfloat16 --repeats 3   # GPU: FLUX.1-schnell, 4 steps

diffusers builds a full-size ``FluxPipeline`` with random weights straight on its device in ``--dtype``
(transformer, VAE, CLIP ViT-L/14's text model, T5 v1.1 XXL's encoder; character tokenizers, since no vocabulary can
be fetched offline) and saves it to ``--folder`` (default: a temporary folder, removed after); eqxdiff loads that
folder with ``eqxdiff.load_pipeline`` (``scan_layers``, as for any long run). Then, in this order:

1. **text encoders** (CLIP pooled + T5 sequence of ``max_sequence_length`` tokens) of one prompt, each framework's
   ``encode_prompt``, timed separately (medians, after a warm-up); diffusers' embeddings are kept. Each framework's
   text encoders are then dropped (T5 XXL is 9.5 GB in bf16), diffusers' before eqxdiff loads, so an 80 GB GPU
   holds both pipelines;
2. **end to end**: each pipeline called with those ``prompt_embeds``/``pooled_prompt_embeds`` and the same initial
   noise (``latents``), ``height x width``, the preset's steps and guidance: noise, scheduler, the denoising loop
   and the VAE decode to images on the host (eqxdiff uint8, diffusers ``output_type="np"``), the two pipelines
   taking turns after one untimed warm-up (eqxdiff compiles there).

Reported: each median with its runs, the ratio eqxdiff / diffusers, eqxdiff's own split (``pipe.timings``: prepare,
denoise, decode), the transformer's FLOPs (``steps x`` the analytic count of ``_flux_configs.py``) and MFU of the
whole call and of the denoising loop on a GPU, peak device memory of each framework, and how far the images are
apart in 8-bit levels. The issue-12 goal: FLUX.1-dev 1024x1024, 28 steps, batch 1, at most 3.3 s on an H100 (diffusers
eager ~6.6 s, with torch.compile ~4.2 s; the transformer's compute floor 2.64 s).
"""

import dataclasses
import statistics
import tempfile
import time
from typing import Literal

import tyro

from _bench import (TorchDevice, fmt_seconds, gib, jax_bytes_in_use, jax_device_name, jax_peak_bytes, load_average,
                    mfu, on_gpu, rel_error, report_cpu_times, report_times, setup_frameworks, time_interleaved,
                    torch_free, torch_peak_bytes, torch_reset_peak, torch_sync)
from _flux_configs import PRESETS, build_pipeline, parameters, transformer_flops
from unet_step import check_attention


@dataclasses.dataclass(frozen=True)
class Args:
    """Time Flux text-to-image end to end (and its text encoders) in eqxdiff and in diffusers."""

    preset: Literal["dev", "schnell", "tiny", "tiny-schnell"] = "tiny"
    """"dev": FLUX.1-dev 1024x1024, 28 steps, guidance 3.5, 512 T5 tokens; "schnell": FLUX.1-schnell 1024x1024,
    4 steps, 256 T5 tokens (both full size: a GPU); "tiny" / "tiny-schnell": the CPU's smoke runs."""
    steps: int | None = None
    """Denoising steps (default: the preset's, 28 dev / 4 schnell)."""
    repeats: int = 3
    """Timed end-to-end runs per framework (after one untimed warm-up); the median is reported."""
    encoder_repeats: int = 5
    """Timed text-encoder calls per framework."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both pipelines."""
    attention: str = "auto"
    """eqxdiff's attention implementation ("auto", or a name in eqxdiff.kernels.IMPLEMENTATIONS)."""
    fused: bool = False
    """eqxdiff's transformer with fused projections (load_pipeline(config_overrides={"transformer":
    {"fused_projections": True}}))."""
    scan_layers: bool = True
    """eqxdiff's repeated layers under lax.scan (load_pipeline(scan_layers=True))."""
    offload_encoders: bool = False
    """eqxdiff keeps its text encoders in host memory outside encoding (their timing then includes the copy)."""
    torch_compile: bool = False
    """Compile diffusers' transformer with torch.compile (during the warm-up) instead of running it eagerly."""
    prompt: str = "a red fox"
    """The prompt encoded by both frameworks' text encoders."""
    folder: str | None = None
    """Where the random pipeline is saved (kept); default: a temporary folder, removed at the end."""
    skip_diffusers: bool = False
    """Time eqxdiff only (diffusers still builds and saves the folder, then is freed)."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls in TF32 in both frameworks; --no-tf32: full float32 in both."""
    max_levels: int | None = None
    """In float32: exit with an error if an image pixel differs from diffusers' by more than this many 8-bit levels
    (or the T5/CLIP embeddings by more than relative 1e-4); default: only print it."""


def drop_encoders(pipe) -> None:
    """Free a pipeline's text encoders (the timed calls pass embeddings)."""
    pipe.text_encoder = None
    pipe.text_encoder_2 = None


def main(args: Args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import eqxdiff
    from eqxdiff.models import flux

    check_attention([args.attention])
    device, header = setup_frameworks(args.torch_device, args.tf32)
    preset = PRESETS[args.preset]
    steps = args.steps or preset.steps
    seq = preset.max_sequence_length
    h, w, c = preset.latent_shape
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    print(f"{header}; preset={args.preset} {preset.height}x{preset.width}, {steps} steps, guidance "
          f"{preset.guidance_scale}, T5 tokens {seq}, dtype={args.dtype}, batch 1")

    scratch = None if args.folder else tempfile.TemporaryDirectory()
    folder = args.folder or scratch.name
    ref, built = build_pipeline(preset, device, torch_dtype)
    t0 = time.perf_counter()
    ref.save_pretrained(folder, safe_serialization=True)
    print(f"diffusers built the random pipeline in {built:.1f}s and saved it in {time.perf_counter() - t0:.1f}s "
          f"(transformer {parameters(ref.transformer) / 1e6:,.1f}M, T5 {parameters(ref.text_encoder_2) / 1e6:,.1f}M, "
          f"CLIP {parameters(ref.text_encoder) / 1e6:,.1f}M, VAE {parameters(ref.vae) / 1e6:,.1f}M parameters)")

    # 1. text encoders, diffusers first (then dropped before eqxdiff loads)
    enc_times, embeddings = {}, {}

    def torch_encode():
        with torch.no_grad():
            e, p, _ = ref.encode_prompt(prompt=args.prompt, prompt_2=None, device=device, max_sequence_length=seq)
        torch_sync(device)
        return e, p

    embeds_t, pooled_t = torch_encode()
    enc_times["diffusers"] = time_interleaved({"diffusers": torch_encode}, args.encoder_repeats, warmup=0)["diffusers"]
    embeddings["diffusers"] = [x.float().cpu().numpy() for x in (embeds_t, pooled_t)]
    drop_encoders(ref)
    torch_free(device)

    t0 = time.perf_counter()
    pipe = eqxdiff.load_pipeline(folder, dtype=args.dtype, scan_layers=args.scan_layers,
                                 attention=None if args.attention == "auto" else args.attention,
                                 offload_encoders=args.offload_encoders,
                                 config_overrides={"transformer": {"fused_projections": True}} if args.fused else None)
    print(f"eqxdiff.load_pipeline: {time.perf_counter() - t0:.1f}s")

    def jax_encode():
        cond = pipe.encode_prompt(args.prompt, max_sequence_length=seq)
        return jax.block_until_ready((cond.embeds, cond.pooled))

    t0 = time.perf_counter()
    jax_encode()
    print(f"eqxdiff encode_prompt first call (compiles): {time.perf_counter() - t0:.1f}s")
    enc_times["eqxdiff"] = time_interleaved({"eqxdiff": jax_encode}, args.encoder_repeats, warmup=0)["eqxdiff"]
    embeddings["eqxdiff"] = [np.asarray(x, np.float32) for x in jax_encode()]
    drop_encoders(pipe)
    enc_med = report_times(enc_times, "text encoders (CLIP + T5)")
    enc_err = [rel_error(a, b) for a, b in zip(embeddings["eqxdiff"], embeddings["diffusers"])]
    print(f"ratio eqxdiff/diffusers, text encoders: {enc_med['eqxdiff'] / enc_med['diffusers']:.2f}   (T5 embeddings "
          f"agree to relative error {enc_err[0]:.1e}, CLIP pooled to {enc_err[1]:.1e})")

    # 2. end to end from the embeddings: same embeddings and noise in both pipelines
    embeds, pooled = embeddings["diffusers"]
    noise = np.random.default_rng(0).standard_normal((1, h, w, c), np.float32)
    guidance = 0.0 if preset.guidance_scale is None else preset.guidance_scale
    common = dict(height=preset.height, width=preset.width, num_inference_steps=steps, guidance_scale=guidance)
    phases: dict[str, list[float]] = {}

    def run_eqxdiff():
        images = np.asarray(pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=noise, progress=False,
                                 **common))
        for k, v in pipe.timings.items():  # the stages' wall times (their compile seconds are 0 once warm)
            if not k.endswith("_compile"):
                phases.setdefault(k, []).append(v)
        return images

    runners = {"eqxdiff": run_eqxdiff}
    if args.skip_diffusers:
        del ref
        torch_free(device)
    else:
        if args.torch_compile:
            ref.transformer = torch.compile(ref.transformer)
        packed = torch.from_numpy(np.array(flux.pack_latents(jnp.asarray(noise)))).to(device, torch_dtype)
        t_embeds = torch.from_numpy(embeds).to(device, torch_dtype)
        t_pooled = torch.from_numpy(pooled).to(device, torch_dtype)

        def run_diffusers():
            with torch.no_grad():
                images = ref(prompt_embeds=t_embeds, pooled_prompt_embeds=t_pooled, latents=packed,
                             output_type="np", **common).images
            torch_sync(device)
            return images

        runners["diffusers" + (" (torch.compile)" if args.torch_compile else "")] = run_diffusers

    resident = jax_bytes_in_use()
    if resident is not None:
        print(f"eqxdiff's weights on the device before the end-to-end runs: {gib(resident)}")
    torch_reset_peak(device)
    outputs = {}
    for name, run in list(runners.items()):
        t0 = time.perf_counter()
        try:
            outputs[name] = run()
        except Exception as e:  # noqa: BLE001 - torch.compile failing on a device image must not lose eqxdiff's run
            if not args.torch_compile or name == "eqxdiff":
                raise
            print(f"{name} failed in its warm-up ({type(e).__name__}: {str(e).splitlines()[0][:200]}); timing "
                  "diffusers eagerly instead")
            ref.transformer = getattr(ref.transformer, "_orig_mod", ref.transformer)
            del runners[name]
            name = "diffusers"
            runners[name] = run
            t0 = time.perf_counter()
            outputs[name] = run()
        compiled = f", {pipe.timings['call_compile']:.1f}s of it compiling" if name == "eqxdiff" else ""
        print(f"{name} first call (warm-up{', compiles' if name == 'eqxdiff' or args.torch_compile else ''}): "
              f"{time.perf_counter() - t0:.1f}s{compiled}")
    phases.clear()
    # core v2: a call that changes only values (steps, guidance, seed) compiles nothing after the first
    for change in (dict(num_inference_steps=max(1, steps - 4)), dict(guidance_scale=guidance + 1.5)):
        t0 = time.perf_counter()
        pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=noise, progress=False, **{**common, **change})
        print(f"eqxdiff with {change}: {time.perf_counter() - t0:.2f}s, {pipe.timings['call_compile']:.2f}s "
              "of it compiling")
    phases.clear()
    print(f"before timing: {load_average()}")
    cpu = {}
    times = time_interleaved(runners, args.repeats, warmup=0, cpu_times=cpu)
    print(f"after timing: {load_average()}")
    med = report_times(times, f"end to end ({steps} steps + decode)")
    if not on_gpu() and device.type == "cpu" and not args.skip_diffusers:
        report_cpu_times(cpu, next(n for n in cpu if n.startswith("diffusers")), times)
    split = {k: statistics.median(v) for k, v in phases.items()}
    print("eqxdiff's split (medians of pipe.timings): " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in split.items())
          + (f"; {fmt_seconds(split['denoise'] / steps)} per denoising step" if "denoise" in split else ""))

    flops = steps * transformer_flops(preset.transformer, preset.image_tokens, seq)
    device_name = jax_device_name()
    print(f"transformer FLOPs of the {steps} steps: {flops / 1e12:.4g} TFLOP (analytic; the VAE decode is not "
          "counted)")
    for name, m in med.items():
        u = mfu(flops, m, device_name)
        print(f"{name} end to end: {flops / m / 1e12:.3g} TFLOP/s" + ("" if u is None else f", MFU {100 * u:.1f}%"))
    if "denoise" in split:
        u = mfu(flops, split["denoise"], device_name)
        print(f"eqxdiff denoising loop: {flops / split['denoise'] / 1e12:.3g} TFLOP/s"
              + ("" if u is None else f", MFU {100 * u:.1f}% of the {device_name}'s dense bf16 peak"))
    for name, peak in (("eqxdiff since the start (its T5 while encoding, the GPU autotuner's scratch too)",
                        jax_peak_bytes()),
                       ("diffusers in the end-to-end runs", None if args.skip_diffusers else torch_peak_bytes(device))):
        if peak is not None:
            print(f"peak device memory, {name}: {gib(peak)}")
    if scratch is not None:
        scratch.cleanup()
    if args.skip_diffusers:
        return
    name = next(n for n in med if n.startswith("diffusers"))
    theirs = (outputs[name] * 255).round()
    diff = np.abs(outputs["eqxdiff"].astype(np.float64) - theirs)
    print(f"ratio eqxdiff/{name}, end to end: {med['eqxdiff'] / med[name]:.2f} ({fmt_seconds(med['eqxdiff'])} vs "
          f"{fmt_seconds(med[name])})   (images differ by at most {int(diff.max())} of 255 levels, mean "
          f"{diff.mean():.2f}; the images' own spread: std {theirs.std():.1f} levels)")
    if args.max_levels is not None and args.dtype == "float32":
        if diff.max() > args.max_levels or max(enc_err) > 1e-4:
            raise SystemExit(f"eqxdiff and diffusers disagree: images by {int(diff.max())} levels (--max-levels "
                             f"{args.max_levels}), embeddings by {max(enc_err):.1e} (1e-4)")


if __name__ == "__main__":
    main(tyro.cli(Args))
