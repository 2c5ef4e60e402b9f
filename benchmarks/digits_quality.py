"""How well the shipped digits model draws the digit it is asked for.

    python benchmarks/digits_quality.py                                   # 200 images, the shipped digits model
    python benchmarks/digits_quality.py --per-digit 20 --steps 20 --guidance-scale 4 --grid docs/digits_grid.png

Generates ``per_digit`` images for each prompt "a handwritten digit {zero..nine}" and labels them with an SVC
trained on scikit-learn's real digits (read through the same 16 px upscale and 8x8 block average as the generated
images). Prints the share labelled as the prompted digit, per digit and overall, and the time taken.
"""

import dataclasses
import time
from pathlib import Path

import tyro


@dataclasses.dataclass(frozen=True)
class Args:
    model: str = "digits"
    """The diffusers pipeline folder to score (default: the digits model shipped with eqxdiff)."""
    per_digit: int = 20
    """Images per digit (10 digits)."""
    steps: int = 20
    """Denoising steps."""
    guidance_scale: float = 4.0
    """Classifier-free guidance scale."""
    scheduler: str | None = None
    """Swap the folder's scheduler (ddim, euler, dpm++2m, ...)."""
    seed: int = 0
    grid: Path | None = None
    """Also save a grid of the first 10 images of each digit here (one row per digit)."""


def main(args: Args) -> float:
    import numpy as np

    import eqxdiff
    from eqxdiff.data.digits import score_pipeline
    from eqxdiff.train import image_grid

    pipe = eqxdiff.load_pipeline(args.model, scheduler=args.scheduler)
    t0 = time.perf_counter()
    result = score_pipeline(pipe, per_digit=args.per_digit, num_inference_steps=args.steps,
                            guidance_scale=args.guidance_scale, seed=args.seed)
    elapsed = time.perf_counter() - t0
    print(f"model {args.model}: {type(pipe.scheduler).__name__}, {args.steps} steps, guidance "
          f"{args.guidance_scale}, seed {args.seed}")
    print("per digit: " + " ".join(f"{d}:{a:.2f}" for d, a in enumerate(result["per_digit"])))
    n = 10 * args.per_digit
    print(f"classifier accuracy on {n} generated images: {result['accuracy']:.3f} "
          f"({round(result['accuracy'] * n)}/{n}); {elapsed:.1f} s including compile")
    if args.grid is not None:
        from PIL import Image

        k = min(10, args.per_digit)
        images = result["images"].reshape(10, args.per_digit, *result["images"].shape[1:])[:, :k]
        grid = image_grid(images.reshape(-1, *images.shape[2:]), columns=k)
        grid = np.kron(grid, np.ones((2, 2, 1), np.uint8))  # 2x nearest-neighbour so 16 px digits are visible
        args.grid.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid).save(args.grid, optimize=True)
        print(f"grid: {args.grid} ({grid.shape[1]}x{grid.shape[0]} px)")
    return result["accuracy"]


if __name__ == "__main__":
    main(tyro.cli(Args))
