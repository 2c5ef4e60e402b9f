"""What every loadable model shares: its config class, checkpoint format and config.json writer."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from ..core import ModelConfig


class PretrainedModel(eqx.Module):
    """Base of modules that ``eqxdiff.load`` builds. Subclasses set ``config_class``, hold the parsed config in a
    static ``config`` field and are constructed as ``Model(config, *, dtype, key)``."""

    config_class: ClassVar[type]
    CHECKPOINT_FORMAT: ClassVar[str] = "diffusers"  # or "transformers"
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = ()  # regexes of checkpoint tensors that carry no weights
    # Modules whose weights stay float32 when the model loads in half precision (bfloat16, float16): names matched
    # against the parts of each checkpoint name ("norm2" keeps "blocks.0.norm2.weight"), as diffusers'
    # ``_keep_in_fp32_modules`` (see :meth:`keep_in_float32`)
    KEEP_IN_FLOAT32: ClassVar[tuple[str, ...]] = ()
    # a text encoder's token table (an nn.Embedding; dotted attribute path), which textual inversion grows; None: none
    INPUT_EMBEDDINGS: ClassVar[str | None] = None

    def fused_tensors(self) -> tuple[tuple[tuple[str, ...], str, tuple[int, ...] | None], ...]:
        """Tensors this model holds fused that checkpoints store apart, as ``(sources, target, sizes)``: name
        templates (``{placeholders}`` as in :mod:`eqxdiff.loading`'s rules) and the pieces' sizes along axis 0
        (``None``: equal). ``eqxdiff.load`` concatenates the sources into the target, ``save_pretrained`` splits
        it back. Default: none."""
        return ()

    @classmethod
    def keep_in_float32(cls, dtype) -> tuple[str, ...]:
        """The module names whose floating weights ``eqxdiff.load`` reads in float32 when the rest loads in
        ``dtype``: :attr:`KEEP_IN_FLOAT32` for a half-precision ``dtype`` (diffusers keeps its
        ``_keep_in_fp32_modules`` for bfloat16 and float16 alike), none otherwise. A model whose reference keeps some
        for float16 only (transformers' ``_keep_in_fp32_modules``) overrides this."""
        return cls.KEEP_IN_FLOAT32 if jnp.finfo(dtype).bits < 32 else ()

    @classmethod
    def with_input_width(cls, config, layer: str, width: int):
        """The config of this model with Linear ``layer`` (its checkpoint name) taking ``width`` input features, for
        a LoRA that widens it (a control LoRA's input layer), or ``None``: that input does not widen. Default:
        none does."""

    def checkpoint_config(self) -> dict:
        """The config.json dict that diffusers/transformers need to rebuild this model."""
        d = self.config.to_dict()  # type: ignore[attr-defined]
        if self.CHECKPOINT_FORMAT == "transformers":
            d["architectures"] = [type(self).__name__]
        else:
            d["_class_name"] = type(self).__name__
        return d


class TransformerConfig(ModelConfig):
    """A diffusion transformer's config: ``num_attention_heads`` heads of ``attention_head_dim`` channels, and
    ``out_channels`` (``None``: ``in_channels``), as diffusers' transformer configs declare them."""

    @property
    def inner_dim(self) -> int:
        """The model width: ``num_attention_heads * attention_head_dim``."""
        return self.num_attention_heads * self.attention_head_dim  # type: ignore[attr-defined]

    @property
    def output_channels(self) -> int:
        """Channels per output token: ``out_channels or in_channels``."""
        return self.out_channels or self.in_channels  # type: ignore[attr-defined]


def check_channels_last(model: str, method: str, what: str, x, channels: int, axes: str) -> None:
    """``ValueError`` unless ``x`` is ``[batch, <axes>, channels]`` (``axes``: "height, width" or "frames, height,
    width"), naming the channels-first mistake and its fix when ``x`` looks like one."""
    rank = 2 + axes.count(",") + 1
    if x.ndim != rank or x.shape[-1] != channels:
        hint = (" It looks channels-first; eqxdiff is channels-last: pass jnp.moveaxis(x, 1, -1)."
                if x.ndim == rank and x.shape[1] == channels else "")
        raise ValueError(f"{model}.{method} expects {what} of shape [batch, {axes}, {channels}] (channels last), got "
                         f"shape {x.shape}.{hint}")
