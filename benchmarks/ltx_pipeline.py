"""LTX-Video text-to-video end to end, eqxdiff's ``LTXPipeline`` against diffusers' in the same run, from one
random-weight folder.

    python benchmarks/ltx_pipeline.py --preset tiny         # a smoke run on the CPU (seconds)
    python benchmarks/ltx_pipeline.py --preset 2b --dtype bfloat16 --repeats 3 --distilled   # GPU: the paper's video

The issue-21 goal: the LTX-Video paper (arXiv 2501.00103) reports 5 s of 24 fps 768x512 video (121 frames) generated
in 2 s on an H100 with the 2B model, with 20 diffusion steps; eqxdiff should take at most 1.6 s for that video with
that recipe. The default here is 20 steps with classifier-free guidance 3 (a batch of 2 per step); ``--guidance-scale
1`` times the 20 steps without guidance (``--steps``, ``--guidance-scale``).

diffusers builds an ``LTXPipeline`` with a random transformer (the preset's config), a random VAE (``--vae``: 0.9.0's
decoder, the paper's; or 0.9.5's timestep-conditioned one) and a narrow random T5 (one layer at the transformer's
caption width: the timed calls pass embeddings, so the text encoder's size does not matter), saves it, and eqxdiff
loads that folder. Both pipelines are then called with the same T5-shaped ``prompt_embeds`` / mask (128 tokens, a
quarter of them padding), the same initial noise, the preset's size, steps and guidance: noise, scheduler, the
denoising loop and the VAE decode to frames on the host, taking turns after one untimed warm-up each. With
``--distilled`` the distilled recipe is timed too: 8 steps as the 0.9.7/0.9.8 distilled model cards' 8 timesteps, no
guidance (a new structure: eqxdiff compiles once more); over the default sigmas, since diffusers' ``LTXPipeline``
takes no custom schedule (the values change what is computed, not its cost). The decode runs at ``decode_timestep``
0.05 with no decode noise (``decode_noise_scale=0``: the two frameworks' draws differ).

Reported: each median with its runs, the ratio eqxdiff / diffusers, eqxdiff's split (``pipe.timings``), how far the
frames are apart in 8-bit levels, and peak device memory.
"""

import dataclasses
import statistics
import tempfile
import time
from typing import Literal

import tyro

from _bench import (TorchDevice, fmt_seconds, gib, jax_peak_bytes, load_average, on_gpu, report_cpu_times,
                    report_times, setup_frameworks, time_interleaved, torch_free, torch_peak_bytes, torch_reset_peak,
                    torch_sync)
from ltx import _LTX_2B, _LTX_13B, _TINY_VAE, _TINY_VAE_090, _VAE_095

DISTILLED_TIMESTEPS = (1000, 993, 987, 981, 975, 909, 725, 0.03)  # the 0.9.7 / 0.9.8 distilled model cards
_TINY = dict(_LTX_2B, in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
             cross_attention_dim=32, num_layers=2, caption_channels=16)
VAES = {"0.9.0": ({}, _TINY_VAE_090), "0.9.5": (_VAE_095, _TINY_VAE)}  # (full size, tiny): diffusers' defaults = 0.9.0


@dataclasses.dataclass(frozen=True)
class Preset:
    transformer: dict
    frames: int
    height: int
    width: int
    tiny: bool = False


PRESETS = {
    "2b": Preset(_LTX_2B, 121, 512, 768),  # the paper's video: 768x512 x 121 frames (5 s at 24 fps), 6144 tokens
    "13b": Preset(_LTX_13B, 121, 512, 768),  # the 13B (0.9.7 / 0.9.8) on the same video
    "tiny": Preset(_TINY, 9, 32, 32, tiny=True),
}


@dataclasses.dataclass(frozen=True)
class Args:
    """Time LTX-Video text-to-video end to end in eqxdiff and in diffusers."""

    preset: Literal["2b", "13b", "tiny"] = "tiny"
    """"2b" / "13b": LTX-Video 2B / 13B at 768x512 x 121 frames (a GPU); "tiny": the CPU's smoke run."""
    vae: Literal["0.9.0", "0.9.5"] = "0.9.0"
    """The VAE's config: 0.9.0 (the paper's, no decoder timestep) or 0.9.5 (timestep-conditioned decoder)."""
    steps: int = 20
    """Denoising steps of the guided recipe."""
    guidance_scale: float = 3.0
    """Classifier-free guidance of the guided recipe (a batch of 2 per step)."""
    distilled: bool = False
    """Also time the distilled recipe (8 timesteps, no guidance)."""
    repeats: int = 3
    """Timed end-to-end runs per framework and recipe (after one untimed warm-up); the median is reported."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both pipelines."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls in TF32 in both frameworks."""
    max_levels: int | None = None
    """In float32: exit with an error if a pixel differs from diffusers' by more than this many 8-bit levels."""


def build_folder(preset: Preset, vae_name: str, folder: str, device, dtype):
    """diffusers' random ``LTXPipeline`` (PyTorch's default initialisation) built on ``device`` in ``dtype`` and
    saved to ``folder``; returns it and the build + save seconds."""
    import diffusers
    import torch
    from transformers import T5Config, T5EncoderModel

    from _flux_configs import torch_defaults
    from eqxdiff.data import character_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(0)
    tokenizer = character_tokenizer(128)
    with torch_defaults(device, dtype):
        t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer) + 3, d_model=preset.transformer["caption_channels"],
                                     d_kv=8, d_ff=32, num_layers=1, num_heads=2, feed_forward_proj="gated-gelu",
                                     pad_token_id=0, eos_token_id=1)).eval()
        # cast: 0.9.5's decoder makes timestep_scale_multiplier in float32 whatever the default (from_pretrained casts)
        vae = diffusers.AutoencoderKLLTXVideo(**VAES[vae_name][preset.tiny]).to(dtype).eval()
        transformer = diffusers.LTXVideoTransformer3DModel(**preset.transformer).eval()
    pipe = diffusers.LTXPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=1024, base_shift=0.95, max_image_seq_len=4096, max_shift=2.05, shift=1.0,
        shift_terminal=0.1, use_dynamic_shifting=True), vae=vae, text_encoder=t5, tokenizer=tokenizer,
        transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe, time.perf_counter() - t0


def time_recipe(name: str, pipe, ref, inputs: dict, recipe: dict, repeats: int, device, torch_dtype) -> dict:
    """One recipe: each pipeline's warm-up, then ``repeats`` interleaved timed runs; prints the medians, eqxdiff's
    split and the frames' distance; returns the medians."""
    import numpy as np
    import torch

    phases: dict[str, list[float]] = {}

    def run_eqxdiff():
        frames = np.asarray(pipe(**inputs["eqxdiff"], **recipe, progress=False))
        for k, v in pipe.timings.items():
            if not k.endswith("_compile"):
                phases.setdefault(k, []).append(v)
        return frames

    runners = {"eqxdiff": run_eqxdiff}
    if ref is not None:
        def run_diffusers():
            with torch.no_grad():
                frames = ref(**inputs["diffusers"], **recipe, output_type="np").frames
            torch_sync(device)
            return np.asarray(frames)
        runners["diffusers"] = run_diffusers
    outputs = {}
    for who, run in runners.items():
        t0 = time.perf_counter()
        outputs[who] = run()
        extra = f", {pipe.timings['call_compile']:.1f}s of it compiling" if who == "eqxdiff" else ""
        print(f"{name}, {who} first call (warm-up): {time.perf_counter() - t0:.1f}s{extra}")
    phases.clear()
    cpu = {}
    times = time_interleaved(runners, repeats, warmup=0, cpu_times=cpu)
    med = report_times(times, f"{name} end to end")
    if not on_gpu() and device.type == "cpu" and ref is not None:
        report_cpu_times(cpu, "diffusers", times)
    split = {k: statistics.median(v) for k, v in phases.items()}
    steps = recipe["num_inference_steps"]
    print(f"{name}, eqxdiff's split (medians of pipe.timings): "
          + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in split.items())
          + (f"; {fmt_seconds(split['denoise'] / steps)} per denoising step" if "denoise" in split else ""))
    if ref is not None:
        theirs = (outputs["diffusers"] * 255).round()
        diff = np.abs(outputs["eqxdiff"].astype(np.float64) - theirs)
        med["levels"] = float(diff.max())
        print(f"ratio {name} eqxdiff/diffusers, end to end: {med['eqxdiff'] / med['diffusers']:.2f} "
              f"({fmt_seconds(med['eqxdiff'])} vs {fmt_seconds(med['diffusers'])})   (frames differ by at most "
              f"{int(diff.max())} of 255 levels, mean {diff.mean():.2f}; their own spread: std {theirs.std():.1f})")
    return med


def main(args: Args) -> None:
    import numpy as np
    import torch

    import eqxdiff

    device, header = setup_frameworks(args.torch_device, args.tf32)
    preset = PRESETS[args.preset]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    scratch = tempfile.TemporaryDirectory()
    ref, built = build_folder(preset, args.vae, scratch.name, device, torch_dtype)
    vae_f, vae_t = ref.vae_spatial_compression_ratio, ref.vae_temporal_compression_ratio
    t, h, w = (preset.frames - 1) // vae_t + 1, preset.height // vae_f, preset.width // vae_f
    c = preset.transformer["in_channels"]
    print(f"{header}\npreset={args.preset}: {preset.width}x{preset.height} x {preset.frames} frames ({t * h * w} "
          f"tokens), VAE {args.vae}, dtype={args.dtype}, batch 1; diffusers built and saved the random pipeline in "
          f"{built:.1f}s ({sum(p.numel() for p in ref.transformer.parameters()) / 1e6:,.1f}M transformer, "
          f"{sum(p.numel() for p in ref.vae.parameters()) / 1e6:,.1f}M VAE parameters)")
    ref.text_encoder = None
    torch_free(device)
    t0 = time.perf_counter()
    pipe = eqxdiff.load_pipeline(scratch.name, dtype=args.dtype)
    pipe.text_encoder = None
    print(f"eqxdiff.load_pipeline: {time.perf_counter() - t0:.1f}s")

    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((1, 128, preset.transformer["caption_channels"]), np.float32)
    mask = np.ones((1, 128), np.int64)
    mask[:, 96:] = 0
    noise = rng.standard_normal((1, t, h, w, c), np.float32)

    def tt(a, dtype=torch_dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    common = dict(height=preset.height, width=preset.width, num_frames=preset.frames, frame_rate=24,
                  decode_timestep=0.05, decode_noise_scale=0.0)
    inputs = {"eqxdiff": dict(prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=embeds * 0,
                              negative_prompt_attention_mask=mask, latents=noise),
              "diffusers": dict(prompt_embeds=tt(embeds), prompt_attention_mask=tt(mask, torch.int64),
                                negative_prompt_embeds=tt(embeds * 0), negative_prompt_attention_mask=tt(mask,
                                                                                                         torch.int64),
                                latents=tt(noise.reshape(1, -1, c), torch.float32))}
    guided = args.guidance_scale > 1  # diffusers' rule: guidance 1 or less runs no unconditional batch
    name = (f"guided ({args.steps} steps, guidance {args.guidance_scale})" if guided
            else f"{args.steps} steps, no guidance")
    recipes = {name: dict(common, num_inference_steps=args.steps, guidance_scale=args.guidance_scale)}
    if args.distilled:
        recipes[f"distilled ({len(DISTILLED_TIMESTEPS)} steps, no guidance)"] = dict(
            common, num_inference_steps=len(DISTILLED_TIMESTEPS), guidance_scale=1.0)
    torch_reset_peak(device)
    print(f"before timing: {load_average()}")
    results = {name: time_recipe(name, pipe, ref, inputs, recipe, args.repeats, device, torch_dtype)
               for name, recipe in recipes.items()}
    print(f"after timing: {load_average()}")
    for who, peak in (("eqxdiff", jax_peak_bytes()), ("diffusers", torch_peak_bytes(device))):
        if peak is not None:
            print(f"peak device memory, {who}: {gib(peak)}")
    scratch.cleanup()
    worst = max(r.get("levels", 0.0) for r in results.values())
    if args.max_levels is not None and args.dtype == "float32" and worst > args.max_levels:
        raise SystemExit(f"eqxdiff and diffusers disagree by {int(worst)} levels (--max-levels {args.max_levels})")


if __name__ == "__main__":
    main(tyro.cli(Args))
