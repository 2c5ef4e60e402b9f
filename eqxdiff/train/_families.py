"""The training families: a pipeline's ``model_index.json`` class name to the :class:`~eqxdiff.train.TrainModel`
bundle that fine-tunes it (``"module:Class"``, imported when asked for). A new family adds its bundle file and one
line here."""

from ..core import resolve_class

TRAIN_FAMILIES: dict[str, str] = {
    "StableDiffusionPipeline": "eqxdiff.train._sd:LatentDiffusion",
    "StableDiffusionXLPipeline": "eqxdiff.train._sdxl:SDXLLatentDiffusion",
    "FluxPipeline": "eqxdiff.train._flux:FluxFlowMatching",
    "WanPipeline": "eqxdiff.train._wan:WanFlowMatching",
}


def train_family(pipeline_class_name: str) -> type:
    """The bundle class that fine-tunes pipelines of ``pipeline_class_name``; ``ValueError`` naming the ones
    eqxdiff trains otherwise."""
    cls = resolve_class(pipeline_class_name, TRAIN_FAMILIES)
    if cls is None:
        raise ValueError(f"eqxdiff does not fine-tune a {pipeline_class_name}; it trains {sorted(TRAIN_FAMILIES)}")
    return cls
