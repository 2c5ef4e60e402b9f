"""Generate images with a Stable Diffusion checkpoint.

    python scripts/generate.py --prompt "a photo of an astronaut riding a horse"
    python scripts/generate.py --model path/to/pipeline --scheduler euler --steps 30 --num-images 4

Prints load, compile and generation times and saves ``image_{i}.png`` with the generation parameters in
each PNG's text metadata.
"""

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Literal

import tyro

# The pipeline committed with the repo (trained by `scripts/train.py --preset digits`), used when it exists.
EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "eqxdiff" / "assets" / "digits"
DEFAULT_MODEL = os.fspath(EMBEDDED_MODEL) if EMBEDDED_MODEL.is_dir() else "stable-diffusion-v1-5/stable-diffusion-v1-5"


@dataclasses.dataclass(frozen=True)
class Args:
    """Text-to-image (or image-to-image with --image) with eqxdiff."""

    prompt: str = "a handwritten digit seven"
    """What to draw."""
    model: str = DEFAULT_MODEL
    """A diffusers pipeline folder or Hugging Face Hub id."""
    negative_prompt: str | None = None
    """What to steer away from (classifier-free guidance's unconditional prompt)."""
    steps: int = 50
    """Number of denoising steps."""
    guidance_scale: float = 7.5
    """Classifier-free guidance scale; 1.0 turns guidance off."""
    guidance_rescale: float = 0.0
    """Rescale guided noise toward the text noise's std (0 = off; 0.7 suggested for zero-SNR models)."""
    height: int | None = None
    """Image height in pixels (a multiple of 8); default: the model's native size."""
    width: int | None = None
    """Image width in pixels (a multiple of 8); default: the model's native size."""
    num_images: int = 1
    """Images per prompt."""
    seed: int = 0
    """Random seed."""
    scheduler: str | None = None
    """Swap the checkpoint's scheduler: ddim, pndm, euler, euler_a, lms, dpm++2m, dpm++2m_karras, ddpm."""
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in."""
    activations_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the latents and activations in the denoising loop."""
    attention: str | None = None
    """Attention implementation (xla, chunked, cudnn, flash, ...); default: chosen for the platform."""
    clip_skip: int | None = None
    """Use the text encoder's hidden state this many layers before the last."""
    image: Path | None = None
    """An initial image for image-to-image."""
    strength: float = 0.8
    """Image-to-image: how much of the schedule to run (1.0 ignores the image)."""
    output_dir: Path = Path("outputs")
    """Where image_{i}.png files go."""
    compilation_cache_dir: Path | None = None
    """Persistent XLA compilation cache folder (later runs skip compiling)."""
    progress: bool = True
    """Show a progress bar."""


class _CompileTimer:
    """Sums JAX's own compile-duration events (tracing, lowering, XLA compile)."""

    def __init__(self):
        import jax

        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, duration, **_):
        if name.startswith("/jax/core/compile/"):
            self.seconds += duration


def main(args: Args) -> list[Path]:
    import jax

    if args.compilation_cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", os.fspath(args.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import numpy as np
    from PIL import Image

    import eqxdiff
    from eqxdiff.pipelines import save_images

    timer = _CompileTimer()
    t0 = time.perf_counter()
    pipe = eqxdiff.load_pipeline(args.model, dtype=args.weights_dtype, scheduler=args.scheduler,
                                 attention=args.attention, activations_dtype=args.activations_dtype)
    load_s = time.perf_counter() - t0
    init_image = None if args.image is None else np.asarray(Image.open(args.image).convert("RGB"))
    compile_before = timer.seconds
    t0 = time.perf_counter()
    images = pipe(args.prompt, args.negative_prompt, num_inference_steps=args.steps,
                  guidance_scale=args.guidance_scale, guidance_rescale=args.guidance_rescale, height=args.height,
                  width=args.width, num_images_per_prompt=args.num_images, seed=args.seed, image=init_image,
                  strength=args.strength, clip_skip=args.clip_skip, progress=args.progress)
    total_s = time.perf_counter() - t0
    compile_s = timer.seconds - compile_before
    params = {k: os.fspath(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(args).items()
              if k not in ("output_dir", "compilation_cache_dir", "progress")}
    params["scheduler"] = type(pipe.scheduler).__name__
    paths = save_images(images, args.output_dir, params)
    print(f"load: {load_s:.2f} s | compile: {compile_s:.2f} s | generation (excluding compile): "
          f"{max(total_s - compile_s, 0.0):.2f} s | total call: {total_s:.2f} s", file=sys.stderr)
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main(tyro.cli(Args))
