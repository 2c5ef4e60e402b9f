"""Wan 2.2 A14B's two experts in a call: the boundary between them (``boundary_ratio``) and the low-noise expert's
``guidance_scale_2``, checked against a folder's ``transformer_2`` and ``boundary_ratio`` (the loaded pipeline's, or
its ``model_index.json`` before loading)."""

from ._checks import InputError


def expert_boundary(ratio, two_experts: bool, guidance_scale_2=None) -> float | None:
    """A call's expert boundary (its ``boundary_ratio``, else the folder's: ``ratio``), checked against the folder
    (``two_experts``: it has a ``transformer_2``) and the call's ``guidance_scale_2`` (it needs a boundary)."""
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
        raise InputError(f"boundary_ratio={ratio!r} must be a number in [0, 1]: the fraction of the training "
                         "timesteps above which the high-noise expert runs (0.875 for Wan 2.2 text-to-video, 0.9 "
                         "for image-to-video)")
    if ratio is not None and not two_experts:
        raise InputError(f"boundary_ratio={ratio} switches to a second expert, but this pipeline has no "
                         "transformer_2 (a Wan 2.2 A14B folder has one); leave boundary_ratio out")
    if guidance_scale_2 is not None and ratio is None:
        raise InputError(f"guidance_scale_2={guidance_scale_2} applies to the low-noise expert (transformer_2), which "
                         "runs only below a boundary_ratio; pass boundary_ratio= (0.875 is Wan 2.2's for "
                         "text-to-video) or leave guidance_scale_2 out")
    return None if ratio is None else float(ratio)
