"""``load_pipeline``: a diffusers pipeline folder (``model_index.json``) to an eqxdiff pipeline."""

import os

from ..loading import CheckpointError, check_dtype, load, read_config, resolve_folder

# model_index.json `_class_name` -> the eqxdiff pipeline class that serves it.
PIPELINES = {
    "StableDiffusionPipeline": "stable_diffusion",
    "StableDiffusionImg2ImgPipeline": "stable_diffusion",
}


def load_tokenizer(folder):
    """The checkpoint's own tokenizer through transformers (no download)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(folder):
        raise CheckpointError(f"tokenizer folder {os.fspath(folder)!r} not found")
    return AutoTokenizer.from_pretrained(os.fspath(folder))


def save_pipeline(pipe, folder, *, dtype=None):
    """Write ``pipe`` as a diffusers pipeline folder (model_index.json, one subfolder per component) that
    :func:`load_pipeline` and diffusers' ``StableDiffusionPipeline.from_pretrained`` both load."""
    import json
    from pathlib import Path

    from ..loading import save_pretrained

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
             "feature_extractor": [None, None], "safety_checker": [None, None], "requires_safety_checker": False,
             "image_encoder": [None, None]}
    for name in ("text_encoder", "unet", "vae"):
        module = getattr(pipe, name)
        save_pretrained(module, folder / name, dtype=dtype)
        library = "transformers" if module.CHECKPOINT_FORMAT == "transformers" else "diffusers"
        index[name] = [library, type(module).__name__]
    pipe.tokenizer.save_pretrained(folder / "tokenizer")
    index["tokenizer"] = ["transformers", type(pipe.tokenizer).__name__]
    (folder / "scheduler").mkdir(exist_ok=True)
    sched = {k: v for k, v in pipe.scheduler.config.to_dict().items() if k != "_use_default_values"}
    sched["_class_name"] = type(pipe.scheduler).__name__
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched, indent=2))
    index["scheduler"] = ["diffusers", sched["_class_name"]]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def load_pipeline(path_or_hub_id, *, dtype=None, revision: str | None = None, variant: str | None = None,
                  scheduler: str | None = None, attention: str | None = None, activations_dtype=None,
                  sharding=None, mesh=None, rules=None, offload_encoders: bool = False, scan_layers: bool = False):
    """Load every component a ``model_index.json`` lists and return the matching pipeline.

    ``dtype`` sets the weights (default float32); ``scheduler`` swaps the checkpoint's scheduler by name
    (see :data:`eqxdiff.schedulers.SCHEDULERS`); ``attention`` picks the attention kernel;
    ``activations_dtype`` (default: the weights' dtype) is the dtype of latents and activations. ``mesh``
    (:func:`eqxdiff.parallel.make_mesh`) loads every weight straight onto its rule-given sharding (``rules``,
    default :data:`eqxdiff.parallel.DEFAULT_RULES`; each device reads only its slices) and runs the pipeline on
    the mesh; ``offload_encoders`` keeps the text encoder in host memory outside prompt encoding.
    ``scan_layers`` stacks the text encoder's and the UNet's repeated layers (run with ``lax.scan``: faster
    compiles, same numbers; see :func:`eqxdiff.nn.scan_layers`).
    """
    from ..schedulers import scheduler_from_config
    from .stable_diffusion import StableDiffusionPipeline

    weights_dtype = check_dtype(dtype) or check_dtype("float32")
    act_dtype = check_dtype(activations_dtype) or weights_dtype
    folder = resolve_folder(path_or_hub_id, revision=revision)
    index = read_config(folder, "model_index.json")
    name = index.get("_class_name")
    if name not in PIPELINES:
        raise CheckpointError(f"unknown pipeline class {name!r} in model_index.json; eqxdiff serves "
                              f"{sorted(PIPELINES)}")
    needed = ("tokenizer", "text_encoder", "unet", "vae", "scheduler")
    missing = [c for c in needed if not index.get(c) or index[c][0] is None]
    if missing:
        raise CheckpointError(f"model_index.json in {os.fspath(folder)!r} lacks component(s) {missing}")
    if mesh is not None and sharding is None:
        from ..parallel import DEFAULT_RULES, sharding_fn

        rules = rules or DEFAULT_RULES
        sharding = sharding_fn(mesh, rules)
    models = {c: load(folder, c, dtype=dtype, variant=variant,
                      sharding=None if offload_encoders and c == "text_encoder" else sharding,
                      scan_layers=scan_layers and c != "vae")  # the VAE has no repeated layers
              for c in ("text_encoder", "unet", "vae")}
    sched = scheduler_from_config(read_config(folder / "scheduler", "scheduler_config.json"), name=scheduler)
    return StableDiffusionPipeline(tokenizer=load_tokenizer(folder / "tokenizer"), scheduler=sched,
                                   attention=attention, activations_dtype=act_dtype, mesh=mesh, rules=rules,
                                   offload_encoders=offload_encoders, **models)
