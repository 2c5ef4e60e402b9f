"""T5 and UMT5 text encoders (Flux's and LTX-Video's ``text_encoder_2``/``text_encoder``, Wan's UMT5), loaded from
transformers folders.

>>> import eqxdiff
>>> t5 = eqxdiff.load("path/to/flux", subfolder="text_encoder_2")   # T5EncoderModel
>>> t5(input_ids, attention_mask=attention_mask).last_hidden_state    # [batch, seq, d_model]

State-dict names are transformers' (``encoder.block.0.layer.0.SelfAttention.q.weight`` ...). Numerics follow
``transformers.T5EncoderModel`` / ``UMT5EncoderModel`` in eval mode: pre-norm blocks with T5's RMS layer norm
(variance in float32, no mean, no bias), self-attention **without** the ``1/sqrt(d)`` scaling and with a learned
relative position bias added to the logits (the padding mask on top of it), a feed-forward of ``feed_forward_proj``
(ReLU, gated-GELU (``gelu_new``, tanh), or any ``[gated-]ACT`` of :data:`FEED_FORWARD_ACTIVATIONS`), and a final layer
norm.

- T5: only block 0 holds the bias table (``relative_attention_bias``, buckets x heads); its bias
  ``[1, heads, seq, seq]`` is computed once and reused by every block. Here the table lives beside the blocks (its
  checkpoint name is still block 0's), so every block is identical and ``scan_layers`` stacks all of them.
- UMT5: every block has its own table and computes its own bias.

The embedding table is tied: transformers writes it as ``shared.weight`` (and the encoder's ``embed_tokens`` is the
same tensor). eqxdiff reads ``shared.weight`` or ``encoder.embed_tokens.weight``, whichever a file holds, and
writes ``shared.weight``. float16 is not advised: T5's activations overflow it (transformers clamps them and keeps
``wo`` in float32; eqxdiff does neither); bfloat16 is fine.
"""

import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Bool, Float, Int, PRNGKeyArray, typechecked
from ..core import ModelConfig, Plan, checkpoint_block, constrain
from ._base import PretrainedModel


# transformers' feed_forward_proj: "ACT" (wo(act(wi x))) or "gated-ACT" (wo(act(wi_0 x) * wi_1 x)), ACT one of its
# activation names (those eqxdiff computes); "gated-gelu" alone means the tanh GELU (gelu_new), as transformers
# reads it.
FEED_FORWARD_ACTIVATIONS = ("relu", "gelu", *(a for a in nn.ACTIVATIONS if a not in ("relu", "gelu")))
FEED_FORWARD_PROJ = (*FEED_FORWARD_ACTIVATIONS, *(f"gated-{act}" for act in FEED_FORWARD_ACTIVATIONS))


@dataclasses.dataclass(frozen=True)
class T5Config(ModelConfig):
    """The ``config.json`` transformers writes for ``T5EncoderModel`` (defaults are transformers'). Dropout is
    never applied (eval mode); ``dropout_rate`` is kept to be written back."""

    SUPPORTED_VALUES: ClassVar = {"feed_forward_proj": FEED_FORWARD_PROJ, "model_type": ("t5",)}
    model_type: ClassVar[str] = "t5"

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    initializer_factor: float = 1.0
    feed_forward_proj: str = "relu"
    pad_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1

    def __post_init__(self):
        super().__post_init__()
        for key in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                    "relative_attention_num_buckets", "relative_attention_max_distance"):
            value = getattr(self, key)
            self.check(not isinstance(value, bool) and value > 0, key, "must be a positive integer")
        self.check(self.relative_attention_num_buckets >= 4, "relative_attention_num_buckets",
                   "must be at least 4 (half the buckets per direction, half of those exact distances)")
        self.check(self.relative_attention_max_distance > self.relative_attention_num_buckets // 4,
                   "relative_attention_max_distance",
                   f"must exceed the exact distances ({self.relative_attention_num_buckets // 4} for "
                   f"relative_attention_num_buckets={self.relative_attention_num_buckets}): transformers builds "
                   "such a model, but its log-spaced buckets then run backwards into the other direction's (below "
                   "the exact distances) or overflow (equal to them), so its outputs are garbage")
        self.check(self.layer_norm_epsilon > 0, "layer_norm_epsilon", "must be a positive number")

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def dense_act_fn(self) -> str:
        """The feed-forward activation as transformers names it ("gated-gelu" is the tanh GELU, ``gelu_new``)."""
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]

    def to_dict(self) -> dict:
        return {**super().to_dict(), "model_type": self.model_type}


@dataclasses.dataclass(frozen=True)
class UMT5Config(T5Config):
    """The ``config.json`` transformers writes for ``UMT5EncoderModel``: T5's keys, UMT5's defaults."""

    SUPPORTED_VALUES: ClassVar = {"feed_forward_proj": FEED_FORWARD_PROJ, "model_type": ("umt5",)}
    model_type: ClassVar[str] = "umt5"

    vocab_size: int = 250112
    d_ff: int = 1024
    num_layers: int = 8
    num_heads: int = 6
    feed_forward_proj: str = "gated-gelu"
    decoder_start_token_id: int | None = 0


def relative_position_buckets(q_len: int, kv_len: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """``[q_len, kv_len]`` int32: the bidirectional relative-position bucket of each (query, key) pair.

    Half the buckets hold keys after the query, half those before; within a half, distances below a quarter of
    ``num_buckets`` get a bucket each and longer ones share logarithmically wider buckets up to ``max_distance``.
    Computed in NumPy at trace time (shapes are static) with transformers' float32 arithmetic, so the buckets at
    the log-scale boundaries are the same as theirs.
    """
    relative = np.arange(kv_len)[None, :] - np.arange(q_len)[:, None]  # key position - query position
    half = num_buckets // 2
    exact = half // 2
    distance = np.abs(relative)
    with np.errstate(divide="ignore"):  # distance 0 is an exact bucket; its log is never used
        log_scaled = (np.log(distance.astype(np.float32) / np.float32(exact))
                      / np.float32(math.log(max_distance / exact)) * np.float32(half - exact))
    wide = np.minimum(exact + np.where(distance < exact, 0, log_scaled).astype(np.int64), half - 1)
    buckets = (relative > 0) * half + np.where(distance < exact, distance, wide)
    return buckets.astype(np.int32)


def _position_bias(table: nn.Embedding, buckets) -> Float[Array, "1 heads q_seq kv_seq"]:
    """The table's ``[buckets, heads]`` rows at ``buckets`` as a ``[1, heads, q_seq, kv_seq]`` logits bias."""
    return jnp.transpose(table(buckets), (2, 0, 1))[None]


def _clamp_float16(x: Array) -> Array:
    """transformers' T5Block after each layer in float16: clip to float16's range, to 1000 inside it if any value
    overflowed (a float32 residual stream, which :class:`T5Stack` keeps in float16, has nothing to clip)."""
    if x.dtype != jnp.float16:
        return x
    big = float(jnp.finfo(jnp.float16).max)
    limit = jnp.where(jnp.isinf(x).any(), big - 1000, big).astype(x.dtype)
    return jnp.clip(x, -limit, limit)


def _normed(layer_norm: nn.RMSNorm, x: Array) -> Array:
    """``layer_norm(x)`` in the norm's weight dtype where that is half precision (transformers' T5LayerNorm): a
    float32 residual stream feeds float16 layers."""
    y = layer_norm(x)
    weight = layer_norm.weight
    return y.astype(weight.dtype) if weight is not None and jnp.finfo(weight.dtype).bits < 32 else y


def _bias_table(config: T5Config, dtype, key) -> nn.Embedding:
    return nn.Embedding(config.relative_attention_num_buckets, config.num_heads, axes=("position", "heads"),
                        dtype=dtype, key=key)


class T5DenseActDense(eqx.Module):
    """``wo(act(wi(x)))`` (``feed_forward_proj="relu"``, or another activation without ``gated-``)."""

    wi: nn.Linear
    wo: nn.Linear
    act: str = eqx.field(static=True)

    def __init__(self, config: T5Config, *, dtype, key: PRNGKeyArray):
        ki, ko = jax.random.split(key)
        self.wi = nn.Linear(config.d_model, config.d_ff, use_bias=False, axes=("mlp", "embed"), dtype=dtype, key=ki)
        self.wo = nn.Linear(config.d_ff, config.d_model, use_bias=False, axes=("embed", "mlp"), dtype=dtype, key=ko)
        self.act = config.dense_act_fn

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        return self.wo(nn.activation(self.act)(self.wi(x)).astype(self.wo.weight.dtype))  # float32 if kept


class T5DenseGatedActDense(eqx.Module):
    """``wo(act(wi_0(x)) * wi_1(x))`` (``feed_forward_proj="gated-gelu"``: the tanh GELU)."""

    wi_0: nn.Linear
    wi_1: nn.Linear
    wo: nn.Linear
    act: str = eqx.field(static=True)

    def __init__(self, config: T5Config, *, dtype, key: PRNGKeyArray):
        k0, k1, ko = jax.random.split(key, 3)
        proj = dict(use_bias=False, axes=("mlp", "embed"), dtype=dtype)
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, key=k0, **proj)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, key=k1, **proj)
        self.wo = nn.Linear(config.d_ff, config.d_model, use_bias=False, axes=("embed", "mlp"), dtype=dtype, key=ko)
        self.act = config.dense_act_fn

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        return self.wo((nn.activation(self.act)(self.wi_0(x)) * self.wi_1(x)).astype(self.wo.weight.dtype))


class T5LayerFF(eqx.Module):
    """``x + mlp(layer_norm(x))``."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"mlp": "DenseReluDense"}

    mlp: T5DenseActDense | T5DenseGatedActDense
    layer_norm: nn.RMSNorm

    def __init__(self, config: T5Config, *, dtype, key: PRNGKeyArray):
        mlp = T5DenseGatedActDense if config.is_gated_act else T5DenseActDense
        self.mlp = mlp(config, dtype=dtype, key=key)
        self.layer_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x):
        return x + self.mlp(_normed(self.layer_norm, x))


class T5LayerSelfAttention(eqx.Module):
    """``x + attention(layer_norm(x))`` with the relative position bias: its own (UMT5) or the one given (T5)."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {
        "attention": "SelfAttention",
        "relative_attention_bias": "SelfAttention.relative_attention_bias",
    }

    attention: nn.SelfAttention
    relative_attention_bias: nn.Embedding | None
    layer_norm: nn.RMSNorm

    def __init__(self, config: T5Config, *, own_bias: bool, dtype, key: PRNGKeyArray):
        ka, kb = jax.random.split(key)
        # T5 folds the scale into its initialisation: the logits are q k^T, unscaled
        self.attention = nn.SelfAttention(config.d_model, heads=config.num_heads, dim_head=config.d_kv, bias=False,
                                          out_bias=False, scale=1.0, names="t5", token_axis=None, dtype=dtype,
                                          key=ka)
        self.relative_attention_bias = _bias_table(config, dtype, kb) if own_bias else None
        self.layer_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x, mask, bias, buckets):
        if self.relative_attention_bias is not None:
            bias = _position_bias(self.relative_attention_bias, buckets)
        return x + self.attention(_normed(self.layer_norm, x), mask=mask, bias=bias)


class T5Block(eqx.Module):
    """One encoder block: self-attention, then feed-forward (transformers' ``layer.0`` and ``layer.1``)."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"self_attention": "layer.0", "feed_forward": "layer.1"}

    self_attention: T5LayerSelfAttention
    feed_forward: T5LayerFF

    def __init__(self, config: T5Config, *, own_bias: bool, dtype, key: PRNGKeyArray):
        ka, kf = jax.random.split(key)
        self.self_attention = T5LayerSelfAttention(config, own_bias=own_bias, dtype=dtype, key=ka)
        self.feed_forward = T5LayerFF(config, dtype=dtype, key=kf)

    def __call__(self, x, mask, bias, buckets):
        return _clamp_float16(self.feed_forward(_clamp_float16(self.self_attention(x, mask, bias, buckets))))


class T5Stack(eqx.Module):
    """The encoder: blocks and the final layer norm (transformers' ``encoder``). With ``per_layer_bias=False``
    (T5) it holds block 0's bias table itself and gives every block the bias it makes."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {
        "relative_attention_bias": "block.0.layer.0.SelfAttention.relative_attention_bias",
    }
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("block",)  # eqxdiff.nn.scan_layers stacks them
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("t5_block",)  # each block's output, for Remat.NAMED

    relative_attention_bias: nn.Embedding | None
    block: tuple[T5Block, ...] | nn.Stacked[T5Block]
    final_layer_norm: nn.RMSNorm
    config: T5Config = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: T5Config, *, per_layer_bias: bool, dtype, key: PRNGKeyArray):
        kt, kb = jax.random.split(key)
        self.relative_attention_bias = None if per_layer_bias else _bias_table(config, dtype, kt)
        self.block = tuple(T5Block(config, own_bias=per_layer_bias, dtype=dtype, key=k)
                           for k in jax.random.split(kb, config.num_layers))
        self.final_layer_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype)
        self.config = config

    def __call__(self, x, mask, output_hidden_states: bool):
        seq = x.shape[1]
        buckets = jnp.asarray(relative_position_buckets(seq, seq, self.config.relative_attention_num_buckets,
                                                        self.config.relative_attention_max_distance))
        bias = None
        if self.relative_attention_bias is not None:  # T5: block 0's bias, shared by every block
            bias = constrain(_position_bias(self.relative_attention_bias, buckets), self.plan,
                             (None, "heads", None, None))
        tokens = ("batch", None, "embed")  # text tokens: not split over the context axis

        def step(block, h):  # block boundaries: sharding constraints and the remat policy
            h = checkpoint_block(block, self.plan)(constrain(h, self.plan, tokens), mask, bias, buckets)
            return checkpoint_name(h, "t5_block")

        embeddings = x
        # the residual stream in float32 where the feed-forwards' wo is (float16 models, transformers'
        # _keep_in_fp32_modules): transformers' turns float32 at block 0's feed-forward, whose float32 output it adds
        blocks = self.block.layers if isinstance(self.block, nn.Stacked) else self.block[0]
        x = x.astype(jnp.promote_types(x.dtype, blocks.feed_forward.mlp.wo.weight.dtype))
        x, outputs = nn.run_layers(self.block, step, x, collect=output_hidden_states)
        last = _normed(self.final_layer_norm, x)
        hidden = (embeddings, *outputs[:-1], last) if output_hidden_states else None
        return last, hidden


class T5EncoderOutput(eqx.Module):
    """What the T5 encoders return. ``hidden_states`` (if asked for) are transformers': the embeddings, the output
    of every block but the last, then ``last_hidden_state`` (after the final layer norm)."""

    last_hidden_state: Float[Array, "batch seq embed"]
    hidden_states: tuple[Float[Array, "batch seq embed"], ...] | None = None


class _T5EncoderBase(PretrainedModel):
    """What ``T5EncoderModel`` and ``UMT5EncoderModel`` share; they differ in their configs' defaults and in whether
    every block has its own bias table (``PER_LAYER_BIAS``)."""

    PER_LAYER_BIAS: ClassVar[bool]
    CHECKPOINT_FORMAT: ClassVar[str] = "transformers"
    # tied embeddings: transformers writes "shared.weight"; other files hold only (or also) the encoder's name. The
    # loader reads either (CHECKPOINT_ALIASES); the encoder's name is what PyTorch's state_dict adds (ignored).
    CHECKPOINT_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"shared.weight": ("encoder.embed_tokens.weight",)}
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = (r"encoder\.embed_tokens\.weight",)

    # transformers' _keep_in_fp32_modules, for float16 only (keep_in_float32): float16 T5 activations overflow in
    # the feed-forward's output projection and the residual stream
    KEEP_IN_FLOAT32: ClassVar[tuple[str, ...]] = ("wo",)

    INPUT_EMBEDDINGS: ClassVar[str] = "shared"

    shared: nn.Embedding
    encoder: T5Stack
    config: T5Config = eqx.field(static=True)

    @classmethod
    def keep_in_float32(cls, dtype) -> tuple[str, ...]:
        """``("wo",)`` for float16 (then the residual stream is float32 too, as transformers'), none otherwise:
        transformers keeps its ``_keep_in_fp32_modules`` for float16 only (bfloat16 has float32's range)."""
        return cls.KEEP_IN_FLOAT32 if jnp.dtype(dtype) == jnp.float16 else ()

    def __init__(self, config: T5Config, *, dtype=jnp.float32, key: PRNGKeyArray):
        ke, ks = jax.random.split(key)
        self.shared = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype, key=ke)
        self.encoder = T5Stack(config, per_layer_bias=self.PER_LAYER_BIAS, dtype=dtype, key=ks)
        self.config = config

    @typechecked
    def __call__(self, input_ids: Int[Array, "batch seq"], *,
                 attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
                 output_hidden_states: bool = False) -> T5EncoderOutput:
        """Encode ``input_ids`` (any length: positions are relative). ``attention_mask`` (1/``True`` = a real
        token) masks padding keys; padded positions still get outputs, computed as transformers does.
        ``output_hidden_states=True`` also returns the embeddings and the blocks' outputs."""
        mask = None if attention_mask is None else attention_mask.astype(bool)
        last, hidden = self.encoder(self.shared(input_ids), mask, output_hidden_states)
        return T5EncoderOutput(last_hidden_state=last, hidden_states=hidden)


class T5EncoderModel(_T5EncoderBase):
    """transformers' ``T5EncoderModel``: the bias table in block 0, shared by every block."""

    config_class: ClassVar[type] = T5Config
    PER_LAYER_BIAS: ClassVar[bool] = False


class UMT5EncoderModel(_T5EncoderBase):
    """transformers' ``UMT5EncoderModel``: T5 with a bias table in every block."""

    config_class: ClassVar[type] = UMT5Config
    PER_LAYER_BIAS: ClassVar[bool] = True


__all__ = ["T5Config", "T5EncoderModel", "T5EncoderOutput", "UMT5Config", "UMT5EncoderModel",
           "relative_position_buckets"]
