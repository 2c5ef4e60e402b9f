"""LTX-Video's original (Lightricks) checkpoint names as conversion rules: the transformer of
``ltx-video-2b-v0.9.x.safetensors`` / ``ltxv-13b-0.9.x-*.safetensors`` (below ``model.diffusion_model.``), as
diffusers' ``convert_ltx_transformer_checkpoint_to_diffusers`` renames it. Re-exported by
:mod:`eqxdiff.loading.formats`.
"""

from ._convert import Rename, Rule
from ._rules import select

LTX_DIFFUSION_MODEL = "model.diffusion_model."  # Lightricks' single files: the transformer below it


def ltx_transformer(*, prefix: str = "") -> tuple[Rule, ...]:
    """The original LTX-Video transformer (``prefix``: where a single file keeps it, :data:`LTX_DIFFUSION_MODEL`) as
    diffusers' ``LTXVideoTransformer3DModel``: ``patchify_proj`` is ``proj_in``, ``adaln_single`` ``time_embed``,
    each attention's ``q_norm`` / ``k_norm`` ``norm_q`` / ``norm_k``; the other names are diffusers'.

    >>> eqxdiff.load("ltx-video-2b-v0.9.5.safetensors", model_class="LTXVideoTransformer3DModel",
    ...              config="Lightricks/LTX-Video-0.9.5", subfolder="transformer",
    ...              conversion=formats.ltx_transformer(prefix=formats.LTX_DIFFUSION_MODEL))
    """
    b = "transformer_blocks.{i}.{attn}."
    rules: list[Rule] = list(select(prefix)) if prefix else []
    rules += [Rename("patchify_proj.{p}", "proj_in.{p}"), Rename("adaln_single.{name}", "time_embed.{name}"),
              Rename(b + "q_norm.{p}", b + "norm_q.{p}"), Rename(b + "k_norm.{p}", b + "norm_k.{p}")]
    return tuple(rules)


__all__ = ["LTX_DIFFUSION_MODEL", "ltx_transformer"]
