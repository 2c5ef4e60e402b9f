"""``python -m eqxdiff.parallel``: text-to-image on a device mesh, one host or many.

Run the same command on every host with ``--process-id`` set per host (or the ``EQXDIFF_*`` variables); process 0
writes the images. Every host loads only the weight slices its devices hold.
"""

import argparse
import os


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eqxdiff.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="diffusers pipeline folder (on every host) or Hub id")
    p.add_argument("--prompt", required=True)
    p.add_argument("--per-device-batch-size", type=float, default=1.0,
                   help="images per device; fractional allowed (0.25 on 4 devices = 1 image)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance-scale", type=float, default=7.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="outputs")
    p.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-host)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    for kind in ("ici", "dcn"):
        for axis, default in (("data", -1), ("fsdp", 1), ("context", 1), ("tensor", 1)):
            p.add_argument(f"--{kind}-{axis}-parallelism", type=int, default=default)
    p.add_argument("--offload-encoders", action="store_true")
    args = p.parse_args(argv)

    from . import MeshConfig, global_batch_size, initialize_distributed, make_mesh

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    import jax

    from ..pipelines import load_pipeline, save_images

    config = MeshConfig(**{k: v for k, v in vars(args).items() if k.endswith("_parallelism")})
    mesh = make_mesh(config)
    n = global_batch_size(args.per_device_batch_size, mesh)
    pipe = load_pipeline(args.model, mesh=mesh, offload_encoders=args.offload_encoders)
    images = pipe(args.prompt, num_images_per_prompt=n, num_inference_steps=args.steps,
                  guidance_scale=args.guidance_scale, seed=args.seed, progress=jax.process_index() == 0)
    if jax.process_index() == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        save_images(images, args.output_dir, parameters={"prompt": args.prompt, "seed": args.seed})
        print(f"wrote {len(images)} image(s) to {args.output_dir} from a mesh of {dict(mesh.shape)}")


if __name__ == "__main__":
    main()
