"""CLIP text encoders (Stable Diffusion's ``text_encoder`` / ``text_encoder_2``), loaded from transformers folders.

>>> import eqxdiff
>>> text_encoder = eqxdiff.load("path/to/sd15", subfolder="text_encoder")
>>> out = text_encoder(input_ids, attention_mask=attention_mask)
>>> out.last_hidden_state, out.pooler_output

State-dict names are transformers' (``text_model.encoder.layers.0.self_attn.q_proj.weight`` ...). Numerics follow
``transformers.CLIPTextModel`` in eval mode: pre-norm layers, causal self-attention plus an optional padding mask,
a final layer norm, and pooling at the end-of-text token.
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Bool, Float, Int, PRNGKeyArray, typechecked
from ..core import ModelConfig, Plan, checkpoint_block, constrain
from ._base import PretrainedModel


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig(ModelConfig):
    """The ``config.json`` that transformers writes for ``CLIPTextModel`` / ``CLIPTextModelWithProjection``.

    Defaults are transformers' (its config.json may omit keys equal to them). Dropout is never applied: the
    encoders run as transformers' do in eval mode, so ``attention_dropout`` is kept only to be written back.
    """

    # hidden_act: any of transformers' activations eqxdiff computes (CLIPMLP takes ACT2FN[hidden_act])
    SUPPORTED_VALUES: ClassVar = {"hidden_act": nn.ACTIVATIONS, "model_type": ("clip_text_model",)}
    model_type: ClassVar[str] = "clip_text_model"

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int | None = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int = 49407
    # not transformers' (its config keeps any key): diffusers' Stable Diffusion pipelines pass the tokenizer's
    # attention mask to a text encoder whose config.json says use_attention_mask=true; the model ignores it
    use_attention_mask: bool = False

    def __post_init__(self):
        super().__post_init__()
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings"):
            self.check(_is_int(getattr(self, key)) and getattr(self, key) > 0, key, "must be a positive integer")
        self.check(self.projection_dim is None or (_is_int(self.projection_dim) and self.projection_dim > 0),
                   "projection_dim", "must be a positive integer (or null for a model without projection)")
        self.check(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                   f"must be divisible by num_attention_heads={self.num_attention_heads}")
        self.check(isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0, "layer_norm_eps",
                   "must be a positive number")
        self.check(_is_int(self.eos_token_id), "eos_token_id", "must be one token id: the pooled output is taken "
                   "at the end-of-text token")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def legacy_pooling(self) -> bool:
        """Configs written before transformers PR #24773 say ``eos_token_id=2`` and pool at the largest token id."""
        return self.eos_token_id == 2

    def to_dict(self) -> dict:
        out = {**super().to_dict(), "model_type": self.model_type}
        if not out["use_attention_mask"]:  # written only where a config.json said it
            del out["use_attention_mask"]
        return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CLIPTextOutput(eqx.Module):
    """What the CLIP text encoders return. ``hidden_states`` (if asked for) holds the embeddings and then each
    layer's output, before the final layer norm, as transformers' ``output_hidden_states=True``."""

    last_hidden_state: Float[Array, "batch seq embed"]
    pooler_output: Float[Array, "batch embed"]
    hidden_states: tuple[Float[Array, "batch seq embed"], ...] | None = None
    text_embeds: Float[Array, "batch proj"] | None = None  # CLIPTextModelWithProjection only


class CLIPMLP(eqx.Module):
    fc1: nn.Linear
    fc2: nn.Linear
    act: str = eqx.field(static=True)

    def __init__(self, config: CLIPTextConfig, *, dtype, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, axes=("mlp", "embed"), dtype=dtype, key=k1)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, axes=("embed", "mlp"), dtype=dtype, key=k2)
        self.act = config.hidden_act

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        return self.fc2(nn.activation(self.act)(self.fc1(x)))


class CLIPEncoderLayer(eqx.Module):
    """Pre-norm transformer layer: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    self_attn: nn.SelfAttention
    layer_norm1: nn.LayerNorm
    mlp: CLIPMLP
    layer_norm2: nn.LayerNorm

    def __init__(self, config: CLIPTextConfig, *, dtype, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.self_attn = nn.SelfAttention(config.hidden_size, heads=config.num_attention_heads,
                                          dim_head=config.head_dim, bias=True, names="clip", token_axis=None,
                                          dtype=dtype, key=ka)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype=dtype, key=km)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, x: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq"] | None, *,
                 causal: bool = True):
        x = x + self.self_attn(self.layer_norm1(x), mask=mask, causal=causal)  # the vision tower: causal=False
        return x + self.mlp(self.layer_norm2(x))


class CLIPTextTransformer(eqx.Module):
    """Embeddings, encoder layers, final layer norm and end-of-text pooling: transformers' ``text_model``."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {
        "token_embedding": "embeddings.token_embedding",
        "position_embedding": "embeddings.position_embedding",
        "layers": "encoder.layers",
    }
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("layers",)  # eqxdiff.nn.scan_layers stacks them
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("clip_layer",)  # each layer's output, for Remat.NAMED

    token_embedding: nn.Embedding
    position_embedding: nn.Embedding
    layers: tuple[CLIPEncoderLayer, ...] | nn.Stacked[CLIPEncoderLayer]
    final_layer_norm: nn.LayerNorm
    config: CLIPTextConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: CLIPTextConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        kt, kp, kl = jax.random.split(key, 3)
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, key=kt)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                               axes=("position", "embed"), dtype=dtype, key=kp)
        self.layers = tuple(CLIPEncoderLayer(config, dtype=dtype, key=k)
                            for k in jax.random.split(kl, config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.config = config

    def __call__(self, input_ids, attention_mask, output_hidden_states: bool, caller: str) -> CLIPTextOutput:
        batch, seq = input_ids.shape
        max_len = self.config.max_position_embeddings
        if seq > max_len:
            raise ValueError(f"{caller}: input_ids has {seq} tokens but max_position_embeddings={max_len}; "
                             f"truncate to at most {max_len} tokens (tokenizer(..., max_length={max_len}, "
                             "truncation=True))")
        mask = None if attention_mask is None else attention_mask.astype(bool)
        x = self.token_embedding(input_ids) + self.position_embedding.weight[:seq]
        tokens = ("batch", None, "embed")  # 77 text tokens: not split over the context axis

        def step(layer, h):  # layer boundaries: sharding constraints and the remat policy
            return checkpoint_name(checkpoint_block(layer, self.plan)(constrain(h, self.plan, tokens), mask),
                                   "clip_layer")

        embeddings = x
        x, outputs = nn.run_layers(self.layers, step, x, collect=output_hidden_states)
        last = self.final_layer_norm(x)
        if self.config.legacy_pooling:
            eos_at = jnp.argmax(input_ids, axis=-1)
        else:  # the first end-of-text token: padding may repeat it
            eos_at = jnp.argmax((input_ids == self.config.eos_token_id).astype(jnp.int32), axis=-1)
        return CLIPTextOutput(last_hidden_state=last, pooler_output=last[jnp.arange(batch), eos_at],
                              hidden_states=(embeddings, *outputs) if output_hidden_states else None)


class CLIPTextModel(PretrainedModel):
    """The CLIP text encoder without projection: Stable Diffusion 1.x/2.x's ``text_encoder``.

    Reads both transformers 4 names (``text_model.``-prefixed, with an old ``position_ids`` buffer) and the
    unprefixed names transformers 5 writes; writes the ``text_model.`` names.
    """

    config_class: ClassVar[type] = CLIPTextConfig
    CHECKPOINT_FORMAT: ClassVar[str] = "transformers"
    CHECKPOINT_KEY_MAP: ClassVar[tuple] = ((r"^(?=(embeddings|encoder|final_layer_norm)\.)", "text_model."),)
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = (r"text_model\.embeddings\.position_ids",)

    INPUT_EMBEDDINGS: ClassVar[str] = "text_model.token_embedding"

    text_model: CLIPTextTransformer
    config: CLIPTextConfig = eqx.field(static=True)

    def __init__(self, config: CLIPTextConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        self.text_model = CLIPTextTransformer(config, dtype=dtype, key=key)
        self.config = config

    @typechecked
    def __call__(self, input_ids: Int[Array, "batch seq"], *,
                 attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
                 output_hidden_states: bool = False) -> CLIPTextOutput:
        """Encode ``input_ids`` (``seq <= max_position_embeddings``). ``attention_mask`` (1/``True`` = a real
        token) masks padding keys on top of the causal mask; padded positions still get outputs, computed as
        transformers does. ``output_hidden_states=True`` also returns the embeddings and each layer's output."""
        return self.text_model(input_ids, attention_mask, output_hidden_states, type(self).__name__)


class CLIPTextModelWithProjection(PretrainedModel):
    """The CLIP text encoder with its ``text_projection``: SDXL's ``text_encoder_2``. Adds ``text_embeds``
    (the projected ``pooler_output``) to the output."""

    config_class: ClassVar[type] = CLIPTextConfig
    CHECKPOINT_FORMAT: ClassVar[str] = "transformers"
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = (r"text_model\.embeddings\.position_ids",)

    INPUT_EMBEDDINGS: ClassVar[str] = "text_model.token_embedding"

    text_model: CLIPTextTransformer
    text_projection: nn.Linear
    config: CLIPTextConfig = eqx.field(static=True)

    def __init__(self, config: CLIPTextConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        config.check(config.projection_dim is not None, "projection_dim",
                     "must be set for CLIPTextModelWithProjection")
        kt, kp = jax.random.split(key)
        self.text_model = CLIPTextTransformer(config, dtype=dtype, key=kt)
        self.text_projection = nn.Linear(config.hidden_size, config.projection_dim, use_bias=False, dtype=dtype,
                                         key=kp)
        self.config = config

    @typechecked
    def __call__(self, input_ids: Int[Array, "batch seq"], *,
                 attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
                 output_hidden_states: bool = False) -> CLIPTextOutput:
        """As :meth:`CLIPTextModel.__call__`, plus ``text_embeds``."""
        out = self.text_model(input_ids, attention_mask, output_hidden_states, type(self).__name__)
        return dataclasses.replace(out, text_embeds=self.text_projection(out.pooler_output))


__all__ = ["CLIPTextConfig", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTextOutput"]
