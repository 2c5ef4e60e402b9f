"""Adapters on projection layers: small modules of arrays whose ``delta()`` is a change of the weight they sit on.

Every projection layer (:class:`~eqxdiff.nn.Linear`, :class:`~eqxdiff.nn.Conv2d`, :class:`~eqxdiff.nn.Conv3d`) holds
an ``adapters`` slot, and so do the layers whose parameters whole differences change (the affine
:class:`~eqxdiff.nn.LayerNorm` / :class:`~eqxdiff.nn.RMSNorm` and :class:`~eqxdiff.nn.ScaleShiftTable`, for
lightx2v's ``diff`` / ``diff_b`` / ``diff_m`` files; :func:`adapted_parameters`): ``None`` (the layer computes
exactly what it did without one) or an :class:`Adapters` stack, one entry per loaded adapter, each with a traced
strength (``scales``) and a traced switch (``enabled``), so changing a strength or switching an adapter off changes
values only and compiles nothing.

An adapter's tensors are kept in PyTorch's layout of the weight it changes, ``[out, in, *kernel]``, as files store
them; its ``delta()`` is that change (float32), its ``delta_bias()`` the bias change if any:

- :class:`LoRA`: ``up @ down`` (``lora_B @ lora_A``), with a ``mid`` core for LoCon's Tucker convolutions
  (``lora_mid``) and an optional ``bias`` (PEFT's ``lora_B.bias``). On a Linear it runs unfused as
  ``(x @ down^T) @ up^T``: the weight-sized delta is never built.
- :class:`LoHa`: LyCORIS' Hadamard product ``(w1a @ w1b) * (w2a @ w2b)``, or with Tucker cores ``t1``/``t2``.
- :class:`LoKr`: LyCORIS' Kronecker product ``kron(w1, w2)``, each factor whole or low rank (``w2`` also Tucker).
- :class:`Diff`: a whole weight (and bias) difference: ``diff``, ``diff_b``.
- :class:`DoRA`: weight decomposition around any of those: a magnitude per output row (PEFT's
  ``lora_magnitude_vector``) or per output row / input column (LyCORIS' ``dora_scale``).

Any scale a file states (``alpha / rank``) is folded into the tensors when the adapter is built; ``scales`` is only
the strength asked for at run time. Each adapter declares the logical axes of its arrays from the weight's
(``axes``: the weight's axes in PyTorch's order), so a sharded weight's adapter is sharded the same way.
"""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float

Axes = tuple[str | None, ...]
EPS = float(np.finfo(np.float32).eps)  # LyCORIS adds float32's eps to the norm it divides by


def xp(*arrays):
    """NumPy for host arrays (adapters are built and padded on the host: no program compiles), else ``jax.numpy``."""
    return np if all(isinstance(a, np.ndarray) for a in arrays if a is not None) else jnp


def _f32(x: Array) -> Array:
    return x.astype(np.float32)


def _pad_axis(x: Array, axis: int, size: int) -> Array:
    """``x`` zero-padded at the end of ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    if x.shape[axis] > size:
        raise ValueError(f"an adapter of rank {x.shape[axis]} cannot be padded to rank {size}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return xp(x).pad(x, widths)


class Adapter(eqx.Module):
    """One adapter on one layer. ``axes``: the logical axes of the layer's weight in PyTorch's order
    ``(out, in, *kernel)`` (static); ``shape`` that weight's PyTorch shape."""

    axes: Axes = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)

    @abc.abstractmethod
    def delta(self) -> Float[Array, "out in *kernel"]:
        """The weight change in PyTorch's layout ``shape``, float32, at strength 1."""

    def delta_bias(self) -> Float[Array, " out"] | None:
        """The bias change, float32, at strength 1 (``None``: none)."""
        return None

    def contribution(self, weight: Float[Array, "out in *kernel"], scale) -> tuple[Array, Array | None]:
        """``(weight change, bias change)`` at strength ``scale`` on a layer of ``weight`` (PyTorch layout, float32).
        Linear in ``scale`` except for DoRA, whose change depends on the weight it decomposes."""
        db = self.delta_bias()
        return scale * self.delta(), None if db is None else scale * db

    @property
    def rank(self) -> int:
        """The rank padding acts on (0: none, a whole difference)."""
        return 0

    def with_rank(self, rank: int) -> "Adapter":
        """The same adapter with its rank axes zero-padded to ``rank`` (same ``delta``)."""
        if rank != self.rank and self.rank:
            raise NotImplementedError
        return self

    @property
    def low_rank(self) -> bool:
        """Whether a Linear may run it as ``(x @ down^T) @ up^T`` without building the delta."""
        return False

    def _out(self):  # the weight's output axis
        return self.axes[0]

    def _in(self):
        return self.axes[1]

    def _kernel(self) -> Axes:
        return tuple(self.axes[2:])


class LoRA(Adapter):
    """``delta = up @ down`` reshaped to the weight: ``down`` ``[rank, in, *kernel]`` (``lora_A`` / ``lora_down``),
    ``up`` ``[out, rank]`` (``lora_B`` / ``lora_up``). With ``mid`` ``[rank, rank, *kernel]`` (LoCon's
    ``lora_mid``) ``down`` is ``[rank, in]`` and ``delta[o, i, ...] = sum up[o, a] mid[a, b, ...] down[b, i]``.
    ``bias`` ``[out]``: PEFT's ``lora_B.bias``."""

    down: Array
    up: Array
    mid: Array | None = None
    bias: Array | None = None

    def param_axes(self):
        k = self._kernel()
        down = (None, self._in()) if self.mid is not None else (None, self._in(), *k)
        return {"down": down[:self.down.ndim], "up": (self._out(), None), "mid": (None, None, *k),
                "bias": (self._out(),)}

    @property
    def rank(self) -> int:
        return self.up.shape[-1]

    @property
    def low_rank(self) -> bool:
        return self.mid is None and len(self.shape) == 2

    def delta(self):
        up, down = _f32(self.up), _f32(self.down)
        if self.mid is None:
            return (up @ down.reshape(down.shape[0], -1)).reshape(self.shape)
        return xp(up).einsum("oa,ab...,bi->oi...", up, _f32(self.mid), down).reshape(self.shape)

    def delta_bias(self):
        return None if self.bias is None else _f32(self.bias)

    def with_rank(self, rank: int) -> "LoRA":
        mid = None if self.mid is None else _pad_axis(_pad_axis(self.mid, 0, rank), 1, rank)
        return LoRA(self.axes, self.shape, _pad_axis(self.down, 0, rank), _pad_axis(self.up, 1, rank), mid,
                    self.bias)

    def apply(self, x: Array, scale) -> Array:
        """``(x @ down^T) @ up^T * scale`` (+ the bias change) in ``x``'s dtype: the unfused path on a Linear."""
        h = jnp.einsum("...i,ri->...r", x, self.down.astype(x.dtype))
        y = jnp.einsum("...r,or->...o", h, self.up.astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias.astype(x.dtype)
        return y * scale.astype(x.dtype)


def _tucker(t: Array, wa: Array, wb: Array) -> Array:
    """LyCORIS' Tucker rebuild: ``t`` ``[r, r, *kernel]``, ``wa`` ``[r, out]``, ``wb`` ``[r, in]`` ->
    ``[out, in, *kernel]`` (``einsum("i j ..., i p, j r -> p r ...")``)."""
    return xp(t).einsum("ij...,ip,jr->pr...", _f32(t), _f32(wa), _f32(wb))


class LoHa(Adapter):
    """LyCORIS' LoHa: ``delta = (w1a @ w1b) * (w2a @ w2b)``, ``w*a`` ``[out, rank]`` and ``w*b`` ``[rank, in * prod
    kernel]``; with Tucker cores ``t1``, ``t2`` ``[rank, rank, *kernel]`` each factor is ``einsum("ij..., jr, ip ->
    pr...", t, w_b, w_a)`` with ``w*a`` ``[rank, out]`` and ``w*b`` ``[rank, in]`` (``hada_w1_a`` ... ``hada_t2``)."""

    w1a: Array
    w1b: Array
    w2a: Array
    w2b: Array
    t1: Array | None = None
    t2: Array | None = None

    def param_axes(self):
        out, tucker = self._out(), self.t1 is not None
        a = (None, out) if tucker else (out, None)
        b = (None, self._in()) if self.w1b.ndim == 2 and (tucker or len(self.shape) == 2) else (None, None)
        t = (None, None, *self._kernel())
        return {"w1a": a, "w2a": a, "w1b": b, "w2b": b, "t1": t, "t2": t}

    @property
    def rank(self) -> int:
        return self.w1b.shape[0]

    def _factor(self, wa, wb, t):
        if t is None:
            return _f32(wa) @ _f32(wb)
        return _tucker(t, wa, wb).reshape(self.shape[0], -1)

    def delta(self):
        return (self._factor(self.w1a, self.w1b, self.t1) * self._factor(self.w2a, self.w2b, self.t2)
                ).reshape(self.shape)

    def with_rank(self, rank: int) -> "LoHa":
        tucker = self.t1 is not None
        a_axis = 0 if tucker else 1

        def core(t):
            return None if t is None else _pad_axis(_pad_axis(t, 0, rank), 1, rank)

        # padding both factors' ranks with zeros adds zero rank-one terms to each product: the same delta
        return LoHa(self.axes, self.shape, _pad_axis(self.w1a, a_axis, rank), _pad_axis(self.w1b, 0, rank),
                    _pad_axis(self.w2a, a_axis, rank), _pad_axis(self.w2b, 0, rank), core(self.t1), core(self.t2))


class LoKr(Adapter):
    """LyCORIS' LoKr: ``delta = kron(w1, w2)`` reshaped to the weight. ``w1`` is whole ``[a, c]`` or ``w1a @ w1b``;
    ``w2`` is whole ``[b, d, *kernel]``, ``w2a @ w2b`` (``[b, r]``, ``[r, d * prod kernel]``) or with a Tucker core
    ``t2`` ``[r, r, *kernel]`` (``w2a`` ``[r, b]``, ``w2b`` ``[r, d]``). Out = ``a * b``, in = ``c * d``."""

    w1: Array | None = None
    w1a: Array | None = None
    w1b: Array | None = None
    w2: Array | None = None
    w2a: Array | None = None
    w2b: Array | None = None
    t2: Array | None = None

    def param_axes(self):  # the Kronecker factors split out and in: not sharded like the weight
        return {name: (None,) * getattr(self, name).ndim for name in ("w1", "w1a", "w1b", "w2", "w2a", "w2b", "t2")
                if getattr(self, name) is not None}

    @property
    def rank(self) -> int:
        return 0 if self.w2b is None and self.w1b is None else (self.w2b if self.w2b is not None else self.w1b).shape[0]

    def delta(self):
        w1 = _f32(self.w1) if self.w1 is not None else _f32(self.w1a) @ _f32(self.w1b)
        kernel = self.shape[2:]
        if self.w2 is not None:
            w2 = _f32(self.w2)
        elif self.t2 is not None:
            w2 = _tucker(self.t2, self.w2a, self.w2b)
        else:
            w2 = _f32(self.w2a) @ _f32(self.w2b)
        out, cin = self.shape[0] // w1.shape[0], self.shape[1] // w1.shape[1]
        w2 = w2.reshape(out, cin, *kernel)
        w1 = w1.reshape(*w1.shape, *(1,) * len(kernel))
        return xp(w1).kron(w1, w2).reshape(self.shape)

    def with_rank(self, rank: int) -> "LoKr":
        if not self.rank:
            return self
        if (self.w1b is not None) and (self.w2b is not None) and self.w1b.shape[0] != self.w2b.shape[0]:
            raise ValueError("a LoKr adapter whose two factors have different ranks cannot be padded")
        pad = dict(w1=self.w1, w1a=self.w1a, w1b=self.w1b, w2=self.w2, w2a=self.w2a, w2b=self.w2b, t2=self.t2)
        if self.w1b is not None:
            pad.update(w1a=_pad_axis(self.w1a, 1, rank), w1b=_pad_axis(self.w1b, 0, rank))
        if self.w2b is not None:
            a_axis = 0 if self.t2 is not None else 1
            pad.update(w2a=_pad_axis(self.w2a, a_axis, rank), w2b=_pad_axis(self.w2b, 0, rank))
            if self.t2 is not None:
                pad["t2"] = _pad_axis(_pad_axis(self.t2, 0, rank), 1, rank)
        return LoKr(self.axes, self.shape, **pad)


class Diff(Adapter):
    """A whole difference: ``diff`` ``[out, in, *kernel]`` (or ``None``) and ``diff_b`` ``[out]`` (or ``None``):
    full fine-tune differences, lightx2v's distillation files, and what any adapter is materialised to where its
    own structure cannot be kept (a stack of layers whose files differ in kind)."""

    diff: Array | None = None
    diff_b: Array | None = None

    def param_axes(self):
        return {"diff": self.axes, "diff_b": (self._out(),)}

    def delta(self):
        if self.diff is None:
            return xp(self.diff_b).zeros(self.shape, np.float32)
        return _f32(self.diff).reshape(self.shape)

    def delta_bias(self):
        return None if self.diff_b is None else _f32(self.diff_b)


DORA_MODES = ("peft", "lycoris")


class DoRA(Adapter):
    """Weight decomposition (DoRA) around ``adapter``: the layer's weight becomes ``W' = m * V / |V|``, ``|V|`` the
    norm of each output row of ``V`` (``rows``) or of each input column.

    ``mode="peft"`` (``lora_magnitude_vector``, diffusers/PEFT): ``V = W + s * delta``, ``m`` ``[out]``, rows;
    strength ``s`` enters ``V``. ``mode="lycoris"`` (``dora_scale``, LyCORIS/kohya files): ``V = W + delta``,
    ``magnitude`` ``[out, 1, ...]`` (rows) or ``[1, in, ...]`` (columns), ``|V| + eps``; strength ``s`` moves from
    ``W`` (0) to ``W'`` (1): ``W + s * (W' - W)``, as ComfyUI applies it (LyCORIS' own merge equals it at 1).
    Either way the change is ``W' - W``; a bias change of ``adapter`` is added at strength ``s``."""

    adapter: Adapter
    magnitude: Array
    mode: str = eqx.field(static=True, default="peft")
    rows: bool = eqx.field(static=True, default=True)

    def param_axes(self):
        rest = (None,) * (self.magnitude.ndim - 1)
        if self.rows:
            return {"magnitude": (self._out(), *rest)}
        return {"magnitude": (None, self._in(), *rest[1:])}

    @property
    def rank(self) -> int:
        return self.adapter.rank

    def with_rank(self, rank: int) -> "DoRA":
        return DoRA(self.axes, self.shape, self.adapter.with_rank(rank), self.magnitude, self.mode, self.rows)

    def delta(self):
        return self.adapter.delta()

    def delta_bias(self):
        return self.adapter.delta_bias()

    def _norm(self, v: Array) -> Array:
        n = xp(v)
        if self.rows:
            return n.sqrt(n.sum(n.square(v).reshape(v.shape[0], -1), axis=1)).reshape(-1, *(1,) * (v.ndim - 1))
        return n.sqrt(n.sum(n.square(v), axis=(0, *range(2, v.ndim)), keepdims=True))

    def factor(self, weight, scale):
        """PEFT's ``m / |W + s * delta|`` (``mode="peft"``), shaped ``[out, 1, ...]``: what the layer's output is
        multiplied by."""
        v = weight + scale * self.adapter.delta()
        return _f32(self.magnitude).reshape(-1, *(1,) * (v.ndim - 1)) / self._norm(v)

    def contribution(self, weight, scale):
        db = self.adapter.delta_bias()
        db = None if db is None else scale * db
        if self.mode == "peft":
            return self.factor(weight, scale) * (weight + scale * self.adapter.delta()) - weight, db
        v = weight + self.adapter.delta()
        norm = self._norm(v)
        return scale * (v * (_f32(self.magnitude).reshape(norm.shape) / (norm + EPS)) - weight), db


class Adapters(eqx.Module):
    """The adapters on one layer: ``entries`` and, per entry, its strength ``scales`` and switch ``enabled`` (1 or
    0), both traced. Which file each entry came from is the caller's bookkeeping, not part of the structure, so a
    file with the same ranks and targets fits the same compiled program."""

    PARAM_AXES = {"scales": (None,), "enabled": (None,)}

    entries: tuple[Adapter, ...]
    scales: Float[Array, " n"]
    enabled: Float[Array, " n"]

    def __init__(self, entries, scales=None, enabled=None):
        self.entries = tuple(entries)
        n = len(self.entries)
        self.scales = np.ones((n,), np.float32) if scales is None else scales
        self.enabled = np.ones((n,), np.float32) if enabled is None else enabled

    def _strength(self, i: int) -> Array:
        return self.scales[..., i] * self.enabled[..., i]

    def _rescales(self) -> bool:
        """Whether a PEFT DoRA entry follows another: PEFT's ``DoraLinearLayer`` multiplies the layer's output so far
        (the weight and the adapters before it, in order) by its factor, not only the weight's."""
        return any(isinstance(a, DoRA) and a.mode == "peft" for a in self.entries[1:])

    def weight_update(self, weight: Array, perm: tuple[int, ...] | None, *, low_rank: bool = False):
        """``(weight change in our layout, bias change)`` (float32, ``None`` where none) of the entries that are not
        run low rank (all if ``low_rank`` is false), for a layer holding ``weight`` (our layout: ``ours =
        transpose(torch, perm)``)."""
        dw, db = None, None
        torch_weight = None
        for i, a in enumerate(self.entries):
            if low_rank and a.low_rank:
                continue
            if torch_weight is None:
                w = _f32(weight)
                torch_weight = w if perm is None else xp(w).transpose(w, tuple(np.argsort(perm)))
            if isinstance(a, DoRA):
                change, bias = a.contribution(torch_weight, self.scales[..., i])
                if a.mode == "peft" and (dw is not None or db is not None):  # the earlier entries' changes too
                    k = a.factor(torch_weight, self.scales[..., i]) - 1
                    if dw is not None:
                        change = change + k * dw
                    if db is not None:
                        bias = k.reshape(-1) * db if bias is None else bias + k.reshape(-1) * db
                change, bias = self.enabled[..., i] * change, None if bias is None else self.enabled[..., i] * bias
            else:
                change, bias = a.contribution(torch_weight, self._strength(i))
            dw = change if dw is None else dw + change
            if bias is not None:
                db = bias if db is None else db + bias
        if dw is not None and perm is not None:
            dw = xp(dw).transpose(dw, perm)
        return dw, db

    def linear(self, x: Array, weight: Array, y: Array) -> Array:
        """A Linear's output ``y = x @ weight^T + bias`` with every entry's change added (low rank where it can:
        not when a PEFT DoRA entry rescales the ones before it)."""
        rescales = self._rescales()
        for i, a in enumerate(self.entries):
            if a.low_rank and not rescales:
                y = y + a.apply(x, self._strength(i))
        dw, db = self.weight_update(weight, None, low_rank=not rescales)
        if dw is not None:
            y = y + jnp.einsum("...i,oi->...o", x, dw.astype(x.dtype))
        if db is not None:
            y = y + db.astype(x.dtype)
        return y


def conv_weight(adapters: Adapters | None, weight: Array, perm, dtype):
    """``(weight, bias change)`` a convolution runs with: its own weight in ``dtype`` when it holds no adapters,
    else ``weight + change`` (summed in float32)."""
    if adapters is None:
        return weight.astype(dtype), None
    dw, db = adapters.weight_update(weight, perm)
    if dw is None:
        return weight.astype(dtype), db
    return (_f32(weight) + dw).astype(dtype), db


_CONV_AXES = {"N": "batch", "D": "frames", "H": "height", "W": "width"}  # adapted_conv's errors


def adapted_conv(x: Array, weight: Array, bias: Array | None, adapters: Adapters | None, perm, *, layer: str,
                 **conv) -> Array:
    """``jax.lax.conv_general_dilated(x, weight, **conv) + bias`` in ``x``'s dtype, run with the ``adapters``'
    change to the weight and then their change to the bias added (:func:`conv_weight`): the convolution of
    :class:`~eqxdiff.nn.Conv2d` and :class:`~eqxdiff.nn.Conv3d`. Input with other than the weight's input channels
    last is an error naming ``layer`` and the layout ``conv["dimension_numbers"]`` gives."""
    lhs, rhs, _ = conv["dimension_numbers"]
    cin = weight.shape[rhs.index("I")]
    if x.shape[-1] != cin:
        layout = ", ".join(_CONV_AXES[a] for a in lhs[:-1])
        raise ValueError(f"{layer} expects channels-last input [{layout}, cin={cin}], got shape {x.shape}")
    weight, bias_change = conv_weight(adapters, weight, perm, x.dtype)
    y = jax.lax.conv_general_dilated(x, weight, **conv)
    for b in (bias, bias_change):
        if b is not None:
            y = y + b.astype(x.dtype)
    return y


def adapted_parameters(adapters: Adapters | None, weight: Array, bias: Array | None = None, *,
                       has_bias: bool = True, owner: str = "layer") -> tuple[Array, Array | None]:
    """``(weight, bias)`` a layer that uses its parameters directly (a norm's scale and shift, a modulation table)
    runs with: as they are without adapters, else ``weight + change`` and ``bias + change`` in float32 (a bias
    change on a layer without a bias becomes its bias). ``has_bias=False``: the layer has no bias to change (an
    RMSNorm); an adapter changing one is an error naming ``owner``."""
    if adapters is None:
        return weight, bias
    dw, db = adapters.weight_update(weight, None)
    if dw is not None:
        weight = _f32(weight) + dw
    if db is not None:
        if not has_bias:
            raise ValueError(f"{owner} has no bias, but an adapter changes one (a diff_b for it): the LoRA file is "
                             "not for this model's layer; load it with strict=False to skip the key, or remove it")
        bias = db if bias is None else _f32(bias) + db
    return weight, bias


def zeros_like(adapter: Adapter) -> Adapter:
    """An adapter of ``adapter``'s structure and shapes whose change is zero (a stacked layer a file skips)."""
    if isinstance(adapter, DoRA):
        raise ValueError("a DoRA adapter cannot be zero-padded into layers its file skips (its magnitude would "
                         "rescale them); give every stacked layer the adapter, or load without scan_layers")
    return jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), adapter)  # on the host: nothing compiles


def describe(adapter: Adapter) -> str:
    """``"LoRA rank 4"``, ``"LoKr"``, ``"DoRA(LoRA rank 8)"`` ... for reports."""
    name = type(adapter).__name__
    if isinstance(adapter, DoRA):
        return f"DoRA({describe(adapter.adapter)})"
    extras = [f"rank {adapter.rank}"] if adapter.rank else []
    if isinstance(adapter, LoRA) and adapter.mid is not None:
        extras.append("Tucker mid")
    if isinstance(adapter, (LoHa,)) and adapter.t1 is not None:
        extras.append("Tucker")
    return name + (f" {', '.join(extras)}" if extras else "")


def adapter_size(adapter: Adapter) -> int:
    """Number of values an adapter holds (for reports)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(adapter))


__all__ = ["Adapter", "Adapters", "DORA_MODES", "Diff", "DoRA", "LoHa", "LoKr", "LoRA", "adapted_parameters",
           "adapted_conv", "adapter_size", "conv_weight", "describe", "zeros_like"]
