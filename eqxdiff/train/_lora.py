"""LoRA training on the shared trainer: adapters put in the projection layers' adapter slots
(:mod:`eqxdiff.nn._adapters`), the only leaves that get gradients and optimizer state, saved as a LoRA file.

>>> config = TrainConfig(model="digits", data="thick-digits/", lora=LoraConfig(rank=4, targets=("attention",)))
>>> train.run(config)                       # OUTPUT_DIR/lora/pytorch_lora_weights.safetensors
>>> pipe.load_lora_weights("runs/train/lora"); pipe.set_adapters("default_0", [0.5])

:func:`add_lora` gives every targeted layer (found by what its weight's logical axes say it is: attention heads, MLP
units, a convolution's kernel) one :class:`~eqxdiff.nn.LoRA` (PEFT's initialisation: ``down`` Kaiming-uniform,
``up`` zero, so training starts from the model itself), or a PEFT :class:`~eqxdiff.nn.DoRA` around one (the
magnitude starts at the weight's row norms); its strength (``Adapters.scales``) is ``alpha / rank``, held with the
frozen half. :func:`lora_filter` marks the adapters' arrays trainable and nothing else, so ``eqx.partition`` leaves
every base weight frozen (never changed, never in the optimizer state). :func:`save_lora` writes the adapters as a
PEFT file (diffusers' ``load_lora_weights`` reads it) or in kohya's layout (the family's ``LORA_KOHYA`` namings).
"""

import dataclasses
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import nn
from ..loading.lora import Naming, write_lora
from ..pipelines._lora_format import load_format
from ._checks import check_choice
from ._family import TrainModel

TARGETS = ("attention", "mlp", "conv")
FORMATS = ("peft", "kohya")
WEIGHT_NAMES = {"peft": "pytorch_lora_weights.safetensors", "kohya": "lora.safetensors"}
_SEED = 0x10BA  # the adapters' initialisation draws from (seed, _SEED): apart from the data's and the noise's


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA training (``--lora.*``): adapters of ``rank`` on the ``targets`` layers train, the model's own weights
    stay frozen. ``rank`` 0 (the default): no LoRA, the denoiser trains in full."""

    rank: int = 0
    """The adapters' rank (4, 8, 16 ...); 0: no LoRA (the whole denoiser trains)."""
    alpha: float | None = None
    """LoRA's alpha: each adapter's change is scaled by alpha / rank; None: alpha = rank (scale 1, diffusers'
    scripts' default)."""
    targets: tuple[str, ...] = ("attention",)
    """The layers that get adapters, any of: attention (the attention projections q, k, v and out), mlp (the
    feed-forward projections), conv (the convolutions: ResNets, samplers, 1x1 projections)."""
    dora: bool = False
    """DoRA (weight-decomposed LoRA, PEFT's use_dora): a trained magnitude per output row besides the low-rank
    direction."""
    text_encoders: bool = False
    """Adapters on the text encoders too (the ones --train-text-encoder trains: Flux's CLIP), on the same targets;
    their embeddings are then encoded every step, not cached."""
    format: str = "peft"
    """The saved file: peft (diffusers' pytorch_lora_weights.safetensors, which load_lora_weights reads) or kohya
    (lora_unet_ / lora_te_ keys with alphas: kohya's sd-scripts, A1111, ComfyUI), in OUTPUT_DIR/lora (or
    --export-dir)."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank} must be >= 0 (0: no LoRA, a full fine-tune)")
        if self.alpha is not None and not 0 < self.alpha < math.inf:
            raise ValueError(f"lora.alpha={self.alpha} must be a positive number (or None: alpha = rank)")
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ValueError(f"lora.targets is empty; give some of {list(TARGETS)}")
        for target in self.targets:
            check_choice("lora.targets", target, TARGETS)
        check_choice("lora.format", self.format, FORMATS)
        if self.rank == 0:  # a full fine-tune: a setting of the adapters would be dropped without a word
            default = LoraConfig.__dataclass_fields__
            given = [f"lora.{f}={getattr(self, f)!r}" for f in ("alpha", "targets", "dora", "text_encoders", "format")
                     if getattr(self, f) != default[f].default]
            if given:
                raise ValueError(f"{', '.join(given)} set{'s' * (len(given) == 1)} LoRA adapters, but lora.rank=0 "
                                 "trains the whole denoiser without any: give lora.rank=4 (or another rank > 0) for "
                                 "a LoRA, or drop them")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``: the strength every adapter trains and runs at."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    @property
    def weight_name(self) -> str:
        return WEIGHT_NAMES[self.format]


def site_kind(site: nn.Site) -> str | None:
    """``"conv"``, ``"attention"``, ``"mlp"`` or ``None`` for an adapter site, by its weight's shape and logical axes
    (``heads`` on a Linear: an attention projection; ``mlp``: a feed-forward one; embeddings, modulations and
    time projections are neither)."""
    if len(site.shape) > 2:
        return "conv"
    if "heads" in site.axes:
        return "attention"
    if "mlp" in site.axes:
        return "mlp"
    return None


def lora_components(bundle: TrainModel, config: LoraConfig) -> list[str]:
    """The bundle's models that get adapters: the trained denoisers (Wan 2.2 A14B: the experts its options train),
    and its trainable text encoders if asked."""
    names = list(bundle.trained_denoisers())
    if config.text_encoders:
        names += [n for n in bundle.trainable_text_encoders() if getattr(bundle, n) is not None]
    return names


def _row_norms(model, sites: list[nn.Site]) -> list[jax.Array]:
    """Each site's weight's norm per output row (over its input and kernel axes; a stacked site's per layer),
    computed where the weights are (one compiled program; a sharded weight is never gathered)."""
    axes = []
    for site in sites:
        out = 0 if site.perm is None else site.perm.index(0)  # where torch's output axis is in our layout
        lead = 0 if site.layers is None else 1
        axes.append(tuple(lead + i for i in range(len(site.shape)) if i != out))
    weights = [nn.resolve_site(model, s).weight for s in sites]

    def norms(ws):
        return [jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=a)).astype(w.dtype)
                for w, a in zip(ws, axes)]

    return jax.jit(norms)(weights)


def _slot(site: nn.Site, dtype, config: LoraConfig, rng: np.random.Generator, magnitude) -> nn.Adapters:
    """The adapters of one site: a LoRA (or DoRA) with PEFT's initialisation, at strength ``alpha / rank``."""
    lead = () if site.layers is None else (site.layers,)
    fan_in = math.prod(site.shape[1:])
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), as PEFT initialises lora_A
    down = rng.uniform(-bound, bound, (*lead, config.rank, *site.shape[1:])).astype(dtype)
    up = np.zeros((*lead, site.shape[0], config.rank), dtype)
    entry = nn.LoRA(site.axes, site.shape, down, up)
    if magnitude is not None:
        entry = nn.DoRA(site.axes, site.shape, entry, magnitude, "peft", True)
    n = (*lead, 1)
    return nn.Adapters((entry,), np.full(n, config.scale, np.float32), np.ones(n, np.float32))


def add_lora(bundle: TrainModel, config: LoraConfig, *, seed: int) -> TrainModel:
    """``bundle`` with adapters on the layers ``config.targets`` names in :func:`lora_components` (drawn from
    ``seed``). ``ValueError`` if a model has none of those layers."""
    rng = np.random.default_rng((seed, _SEED))
    for name in lora_components(bundle, config):
        model = getattr(bundle, name)
        sites = [s for s in nn.adapter_sites(model) if site_kind(s) in config.targets]
        if not sites:
            raise ValueError(f"the {name} has no layers of lora.targets={list(config.targets)}; target some of "
                             f"{list(TARGETS)}")
        norms = _row_norms(model, sites) if config.dora else [None] * len(sites)
        slots = {s.path: _slot(s, nn.resolve_site(model, s).weight.dtype, config, rng, m)
                 for s, m in zip(sites, norms)}
        slots = {p: jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, a)
                 for p, a in slots.items()}
        bundle = eqx.tree_at(lambda b, n=name: getattr(b, n), bundle, nn.with_adapters(model, slots))
    return bundle


def lora_filter(bundle: TrainModel):
    """A filter spec marking the adapters' arrays (every ``Adapters.entries`` leaf: LoRA factors, DoRA
    magnitudes) and nothing else: not their strengths and switches, not a single weight of the model."""

    def trainable(path, leaf) -> bool:
        return eqx.is_inexact_array(leaf) and any(getattr(k, "name", None) == "entries" for k in path)

    return jax.tree_util.tree_map_with_path(trainable, bundle)


def kohya_layouts(bundle: TrainModel):
    """The name layouts the family's ``LORA_KOHYA`` namings refer to (its pipeline's LoRA format's)."""
    fmt = load_format(bundle.pipeline_class().LORA_FORMAT)
    return () if fmt is None else fmt.layouts


def save_lora(bundle: TrainModel, config: LoraConfig, path, *, dtype=None) -> str:
    """Write the bundle's adapters to ``path``: PEFT keys (``unet.``, ``text_encoder.`` ... with diffusers'
    metadata) or kohya's (the family's ``LORA_KOHYA`` namings: ``lora_unet_`` with its layout's names, ``lora_te_``
    ...), tensors in ``dtype`` (default float32), the alpha of the config. A trained denoiser other than
    ``DENOISER`` (Wan 2.2 A14B's ``transformer_2``) is written to a file of its own beside ``path``,
    ``<stem>.<name>.safetensors``, named as ``DENOISER`` is: the form its family's loaders read into that model
    (diffusers' ``load_lora_weights(file, load_into_transformer_2=True)``, the community's high / low noise pairs).
    Returns what was written."""
    alpha = float(config.rank if config.alpha is None else config.alpha)

    def write(file, models):
        if config.format == "peft":
            namings, layouts = [Naming(f"{n}.", n, label="PEFT") for n in models], ()
        else:
            namings, layouts = bundle.LORA_KOHYA, kohya_layouts(bundle)
        return write_lora(file, models, namings, layouts, style=config.format, alpha=alpha,
                          dtype=np.dtype(dtype or np.float32))

    own = [n for n in bundle.trained_denoisers() if n != bundle.DENOISER]
    models = {n: getattr(bundle, n) for n in lora_components(bundle, config) if n not in own}
    path = Path(path)
    written = [write(path, models)] if models else []
    written += [write(path.with_name(f"{path.stem}.{n}{path.suffix}"), {bundle.DENOISER: getattr(bundle, n)})
                for n in own]
    return " and ".join(written)


__all__ = ["FORMATS", "TARGETS", "LoraConfig", "add_lora", "lora_components", "lora_filter", "save_lora",
           "site_kind"]
