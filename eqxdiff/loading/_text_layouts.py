"""Text encoders in single files: OpenAI's CLIP in transformers' names (:class:`ClipText`) and OpenCLIP towers
(:class:`OpenClipText`), as layout parts with their conversion rules and configs inferred from the tensors."""

import dataclasses
from collections.abc import Mapping

import numpy as np

from ..models.clip import CLIPTextConfig
from ._convert import Drop, Rename, Rule
from ._layout import Part, Stored, cannot_infer, heads
from ._rules import select
from .formats import openclip_text

_CLIP_IDS = {"bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1}  # CLIP's tokenizer


def clip_text(prefix: str, view=None) -> tuple[Rule, ...]:
    """A CLIP text encoder stored in transformers' names under ``prefix`` (read as ``CLIPTextModel``: a projection
    or logit scale some savers add is dropped); files from before transformers named the ``text_model`` wrapper
    (``view`` shows which) get it added."""
    rules = (*select(prefix), Drop(("text_projection.weight", "logit_scale"), optional=True))
    if view is not None and not any(n.startswith(prefix + "text_model.") for n in view.names()):
        rules = (*rules, Rename("{name}", "text_model.{name}"))
    return rules


def openclip_text_rules(prefix: str, config: CLIPTextConfig, *, projection: bool,
                        stored_layers: int = 0) -> tuple[Rule, ...]:
    """An OpenCLIP text tower under ``prefix`` (:func:`eqxdiff.loading.formats.openclip_text`) as transformers'
    ``CLIPTextModelWithProjection`` of ``config`` (``projection=False``: ``CLIPTextModel``). Blocks past
    ``config.num_hidden_layers`` (``stored_layers`` in the file) are dropped: SD 2.x files keep a last block that
    the pipeline never uses (it takes the penultimate layer)."""
    extra = tuple(f"transformer.resblocks.{i}.{{p}}" for i in range(config.num_hidden_layers, stored_layers))
    return (*select(prefix), *((Drop(extra),) if extra else ()), *openclip_text(projection=projection))


def _text_config(where: str, name: str, prefix: str, *, vocab: int, width: int, positions: int, layers: int,
                 mlp: int, projection: int, act: str) -> dict:
    if layers < 1:
        raise cannot_infer(where, f"the {name} under {prefix!r} has no layers")
    return {"vocab_size": vocab, "hidden_size": width, "intermediate_size": mlp, "projection_dim": projection,
            "num_hidden_layers": layers, "num_attention_heads": heads(width), "max_position_embeddings": positions,
            "hidden_act": act, "layer_norm_eps": 1e-5, **_CLIP_IDS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClipText(Part):
    """OpenAI's CLIP text encoder in transformers' names (:func:`clip_text`). Its config from the tensors:
    vocabulary, width, positions, depth, MLP width; 64 channels a head, ``hidden_act`` (quick-GELU) and CLIP's
    tokenizer ids given."""

    model_class: str = "CLIPTextModel"
    hidden_act: str = "quick_gelu"

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        return clip_text(self.prefix, view)

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        t = Stored(view, self.prefix)
        base = "text_model." if t.has("text_model.embeddings.token_embedding.weight") else ""
        vocab, width = t.shape(f"{base}embeddings.token_embedding.weight", where, "the token embedding")
        return _text_config(
            where, self.name, self.prefix, vocab=vocab, width=width,
            positions=t.shape(f"{base}embeddings.position_embedding.weight", where, "the position embedding")[0],
            layers=t.count(f"{base}encoder.layers"),
            mlp=t.shape(f"{base}encoder.layers.0.mlp.fc1.weight", where, "the first layer's MLP")[0],
            projection=width, act=self.hidden_act)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenClipText(Part):
    """An OpenCLIP text tower (:func:`openclip_text_rules`): ``CLIPTextModelWithProjection`` keeps its projection,
    ``CLIPTextModel`` drops it. Its config from the tensors: vocabulary, width, positions, depth, MLP width,
    projection; 64 channels a head and ``hidden_act`` (GELU) given. ``unused_blocks``: the last blocks a file holds
    that the pipeline never runs (SD 2.x: one; it takes the penultimate layer), dropped when reading and written as
    zeros (an identity) so a file keeps the family's convention. Only a GELU text encoder is written in this part
    (it tells SD 2.x's OpenCLIP from SD 1.x's CLIP)."""

    model_class: str = "CLIPTextModelWithProjection"
    hidden_act: str = "gelu"
    unused_blocks: int = 0

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        stored = Stored(view, self.prefix).count("transformer.resblocks") if view is not None else 0
        return openclip_text_rules(self.prefix, config, stored_layers=stored,
                                   projection=self.model_class == "CLIPTextModelWithProjection")

    def infer(self, view, *, where: str, configs: Mapping) -> dict:
        t = Stored(view, self.prefix)
        vocab, width = t.shape("token_embedding.weight", where, "the token embedding")
        return _text_config(
            where, self.name, self.prefix, vocab=vocab, width=width,
            positions=t.shape("positional_embedding", where, "the position embedding")[0],
            layers=t.count("transformer.resblocks") - self.unused_blocks,
            mlp=t.shape("transformer.resblocks.0.mlp.c_fc.weight", where, "the first block's MLP")[0],
            projection=t.shape("text_projection", where)[1] if t.has("text_projection") else width,
            act=self.hidden_act)

    def fits(self, config) -> bool:
        return config.hidden_act == self.hidden_act

    def extra_tensors(self, config, written=None) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i in range(self.unused_blocks):
            out.update(openclip_padding_block(config, self.prefix, config.num_hidden_layers + i))
        return out


def openclip_padding_block(config: CLIPTextConfig, prefix: str, index: int) -> dict[str, np.ndarray]:
    """An OpenCLIP block of zeros (an identity: zero norm scales, zero projections) at ``index``: the unused last
    block an SD 2.x file holds, written so the file keeps SD 2.x's convention."""
    h, m, dt = config.hidden_size, config.intermediate_size, np.float32
    shapes = {"attn.in_proj_weight": (3 * h, h), "attn.in_proj_bias": (3 * h,), "attn.out_proj.weight": (h, h),
              "attn.out_proj.bias": (h,), "ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,),
              "ln_2.bias": (h,), "mlp.c_fc.weight": (m, h), "mlp.c_fc.bias": (m,), "mlp.c_proj.weight": (h, m),
              "mlp.c_proj.bias": (h,)}
    return {f"{prefix}transformer.resblocks.{index}.{k}": np.zeros(s, dt) for k, s in shapes.items()}
