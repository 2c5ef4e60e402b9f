"""Generate images or videos: ``eqxdiff-generate`` (:mod:`eqxdiff.cli.generate`), run from a checkout.

    python scripts/generate.py --prompt "a handwritten digit seven" --num-images 4   # the shipped digits model
    python scripts/generate.py --model path/to/pipeline --prompt "a fox" --scheduler euler --steps 30
    python scripts/generate.py --model path/to/pipeline --help                       # that pipeline's options
    python scripts/generate.py --model path/to/sdxl-base --refiner path/to/sdxl-refiner --denoising-end 0.8
    python scripts/generate.py --model path/to/sd15 --controlnet path/to/canny --control-image edges.png
    python scripts/generate.py --model model.safetensors --config path/to/diffusers-folder --prompt "a fox"

The ``--model`` folder's pipeline class decides the family options (the default, the shipped digits model, was
trained by ``python scripts/train.py digits``); ``--controlnet`` runs its ControlNet pipeline, ``--refiner`` finishes
its latents with a second pipeline. Images go to ``outputs/image_{i}.png``, numbered on after earlier
ones unless ``--overwrite``, with the generation parameters in each file.
"""

from eqxdiff.cli.generate import cli

if __name__ == "__main__":
    cli()
