"""A file's record as an adapter (:mod:`eqxdiff.nn._adapters`) of the layer it adapts, built on the host in NumPy
(nothing compiles), with the file's scale (``alpha / rank``) folded into its tensors; cut into the rows of several
layers (a fused file tensor over separate layers) or joined from several (separate file tensors over a fused layer).

The scale rule (:func:`file_scale`): LoRA / LoCon ``alpha / rank`` (``alpha / sqrt(rank)`` under PEFT's
``use_rslora``), with ``alpha`` from the file's ``.alpha`` key, else diffusers/PEFT's ``lora_adapter_metadata``
(``alpha_pattern``, then ``lora_alpha``); without either, ``alpha = rank`` (scale 1) for every module, whatever its
rank: diffusers' rule for PEFT files and kohya's for files without alpha keys. LoHa ``alpha / rank``; LoKr ``alpha /
rank`` when a factor is low rank (its rank), else 1 (LyCORIS); full differences 1.
"""

import math

import jax
import numpy as np

from .. import nn
from ._errors import CheckpointError
from ._lora_file import Record


def file_scale(record: Record, peft: tuple[float | None, bool] = (None, False)) -> float:
    """The scale the file gives ``record``'s change (see the module docstring); ``peft``: :func:`peft_alpha`'s."""
    t = record.tensors
    alpha, rslora = (record.alpha, False) if record.alpha is not None else peft
    if alpha is None or record.kind == "diff":
        return 1.0
    if record.kind == "lora":
        rank = t["down"].shape[0]
        return alpha / (math.sqrt(rank) if rslora else rank)
    if record.kind == "loha":
        return alpha / t["w1b"].shape[0]
    decomposed = t.get("w2b", t.get("w1b"))
    return 1.0 if decomposed is None else alpha / decomposed.shape[0]


def _out_rows(record: Record) -> int:
    t = record.tensors
    if record.kind == "lora":
        return t["up"].shape[0]
    if record.kind == "loha":
        return t["w1a"].shape[1] if "t1" in t else t["w1a"].shape[0]
    if record.kind == "diff":
        return (t["diff"] if "diff" in t else t["diff_b"]).shape[0]
    w1 = t["w1"] if "w1" in t else t["w1a"]
    w2 = t["w2"] if "w2" in t else t["w2a"]
    return w1.shape[0] * (w2.shape[1] if "t2" in t else w2.shape[0])


def _host(x, dtype) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(dtype)


def _lora(rec: Record, shape, axes, scale, dtype) -> nn.LoRA:
    t = rec.tensors
    down, up = np.asarray(t["down"]), np.asarray(t["up"])
    rank, inner = down.shape[0], math.prod(shape[1:])
    mid = t.get("mid")
    if mid is not None:
        if down.reshape(rank, -1).shape[1] != shape[1] or tuple(mid.shape[2:]) != tuple(shape[2:]):
            raise ValueError(f"lora_down {down.shape} and lora_mid {mid.shape}")
        down = down.reshape(rank, shape[1])
        mid = _host(mid, dtype)
    elif down.size != rank * inner:
        raise ValueError(f"lora_down {down.shape}")
    else:
        down = down.reshape(rank, *shape[1:])
    up32 = np.asarray(up, np.float32).reshape(shape[0], -1) * scale
    if up32.shape[1] != rank:
        raise ValueError(f"lora_up {up.shape} of another rank than lora_down {tuple(t['down'].shape)}")
    bias = t.get("bias")
    bias = None if bias is None else _host(np.asarray(bias, np.float32) * scale, dtype)
    return nn.LoRA(axes, shape, _host(down, dtype), up32.astype(dtype), mid, bias)


def _loha(rec: Record, shape, axes, scale, dtype) -> nn.LoHa:
    t = rec.tensors
    w = {k: np.asarray(t[k], np.float32) for k in ("w1a", "w1b", "w2a", "w2b")}
    w["w1a"] = w["w1a"] * scale
    if "t1" in t:
        t1, t2 = (_host(t[k], dtype) for k in ("t1", "t2"))
    else:
        t1 = t2 = None
        w["w1b"], w["w2b"] = (w[k].reshape(w[k].shape[0], -1) for k in ("w1b", "w2b"))
    return nn.LoHa(axes, shape, *(w[k].astype(dtype) for k in ("w1a", "w1b", "w2a", "w2b")), t1, t2)


def _lokr(rec: Record, shape, axes, scale, dtype) -> nn.LoKr:
    t = rec.tensors
    parts = {k: np.asarray(t[k], np.float32) for k in ("w1", "w1a", "w1b", "w2", "w2a", "w2b", "t2") if k in t}
    first = "w1" if "w1" in parts else "w1a"
    parts[first] = parts[first] * scale
    return nn.LoKr(axes, shape, **{k: v.astype(dtype) for k, v in parts.items()})


def _diff(rec: Record, shape, axes, scale, dtype) -> nn.Diff:
    t = rec.tensors
    diff = None if "diff" not in t else _host(np.asarray(t["diff"]).reshape(shape), dtype)
    diff_b = None if "diff_b" not in t else _host(np.asarray(t["diff_b"]).reshape(-1), dtype)
    return nn.Diff(axes, shape, diff, diff_b)


_BUILDERS = {"lora": _lora, "loha": _loha, "lokr": _lokr, "diff": _diff}


def _with_difference(adapter: nn.Adapter, rec: Record, shape, axes, dtype) -> nn.Adapter:
    """``adapter`` plus the whole differences its module also holds (``diff``, ``diff_b``: lightx2v's LoRA pairs with
    bias differences), which the file's scale does not touch (ComfyUI and lightx2v add them as they are; diffusers
    loads ``diff_b`` as PEFT's ``lora_B.bias`` of a LoRA its converter rescales to scale 1): a LoRA takes a bias
    difference as its bias; otherwise the sum is one :class:`~eqxdiff.nn.Diff`."""
    t = rec.tensors
    diff_b = None if "diff_b" not in t else np.asarray(t["diff_b"], np.float32).reshape(-1)
    old_bias = adapter.delta_bias()
    bias = diff_b if old_bias is None else (np.asarray(old_bias, np.float32) + (0 if diff_b is None else diff_b))
    if isinstance(adapter, nn.LoRA) and "diff" not in t:
        return nn.LoRA(axes, shape, adapter.down, adapter.up, adapter.mid, bias.astype(dtype))
    delta = np.asarray(adapter.delta(), np.float32)
    if "diff" in t:
        delta = delta + np.asarray(t["diff"], np.float32).reshape(shape)
    return nn.Diff(axes, shape, delta.astype(dtype), None if bias is None else bias.astype(dtype))


def build_adapter(rec: Record, layer_shape: tuple[int, ...], axes, *, scale: float, dtype, where: str) -> nn.Adapter:
    """``rec`` as an adapter of a weight ``[rows, *layer_shape[1:]]`` (its rows from its own tensors; input and
    kernel the layer's), ``scale`` folded in, in ``dtype``, NumPy leaves. ``where`` names the module in errors."""
    shape = (_out_rows(rec), *layer_shape[1:])
    try:
        adapter = _BUILDERS[rec.kind](rec, shape, axes, scale, dtype)
        if rec.kind != "diff" and ("diff" in rec.tensors or "diff_b" in rec.tensors):
            adapter = _with_difference(adapter, rec, shape, axes, dtype)
        delta = adapter.delta()  # checks the tensors make the layer's shape
        if delta.size != math.prod(shape):
            raise ValueError(f"a change of {delta.size} values")
    except (ValueError, TypeError) as e:
        sizes = {k: tuple(v.shape) for k, v in rec.tensors.items()}
        raise CheckpointError(f"{where}: the file's {rec.kind} tensors {sizes} do not fit the layer's weight "
                              f"{tuple(layer_shape)} ({e}): the file is for another model (or another size of it)"
                              ) from None
    if rec.magnitude is None:
        return adapter
    if isinstance(adapter, nn.Diff) and rec.kind != "diff":
        raise CheckpointError(f"{where}: a DoRA magnitude beside whole differences (diff / diff_b) of the same layer; "
                              "eqxdiff does not know how a file means them to combine")
    m = np.asarray(rec.magnitude, np.float32)
    if rec.dora == "peft":
        if m.size != shape[0]:
            raise CheckpointError(f"{where}: a DoRA magnitude of {m.size} values for {shape[0]} output rows")
        return nn.DoRA(axes, shape, adapter, m.reshape(-1).astype(dtype), "peft", True)
    rows = m.shape[0] == shape[0] and m.size == shape[0]
    if not rows and not (m.size == shape[1] and m.shape[0] == 1):
        raise CheckpointError(f"{where}: dora_scale of shape {m.shape} fits neither the {shape[0]} output rows nor "
                              f"the {shape[1]} input columns of the layer")
    return nn.DoRA(axes, shape, adapter, m.astype(dtype), "lycoris", rows)


def _dtype(adapter: nn.Adapter) -> np.dtype:
    return np.asarray(jax.tree.leaves(adapter)[0]).dtype


def rows_of(adapter: nn.Adapter, start: int, stop: int) -> nn.Adapter:
    """The part of ``adapter`` changing output rows ``[start, stop)``: a LoRA keeps its factors (its ``up`` cut), a
    DoRA over rows its magnitude cut; anything else is materialised as a :class:`~eqxdiff.nn.Diff`."""
    if start == 0 and stop == adapter.shape[0]:
        return adapter
    shape = (stop - start, *adapter.shape[1:])
    if isinstance(adapter, nn.LoRA):
        bias = None if adapter.bias is None else adapter.bias[start:stop]
        return nn.LoRA(adapter.axes, shape, adapter.down, adapter.up[start:stop], adapter.mid, bias)
    if isinstance(adapter, nn.DoRA):
        if not adapter.rows:
            raise CheckpointError("a DoRA over input columns cannot be split between layers (its norms span all "
                                  "of a fused tensor's rows)")
        return nn.DoRA(adapter.axes, shape, rows_of(adapter.adapter, start, stop), adapter.magnitude[start:stop],
                       adapter.mode, True)
    delta, bias, dtype = adapter.delta(), adapter.delta_bias(), _dtype(adapter)
    return nn.Diff(adapter.axes, shape, np.asarray(delta[start:stop]).astype(dtype),
                   None if bias is None else np.asarray(bias[start:stop]).astype(dtype))


def assemble(pieces: list[tuple[int, nn.Adapter]], shape, axes, where: str) -> nn.Adapter:
    """One adapter of a layer of weight ``shape`` from ``(first row, adapter)`` pieces over some of its rows (rows
    no piece covers are unchanged): LoRAs side by side as one LoRA (their ranks concatenated, ``up`` block
    diagonal); otherwise a :class:`~eqxdiff.nn.Diff`."""
    pieces = sorted(pieces, key=lambda p: p[0])
    for (a, x), (b, _) in zip(pieces, pieces[1:]):
        if a + x.shape[0] > b:
            raise CheckpointError(f"{where}: two of the file's modules change the same rows of this layer")
    if len(pieces) == 1 and pieces[0][0] == 0 and pieces[0][1].shape[0] == shape[0]:
        return pieces[0][1]
    adapters = [a for _, a in pieces]
    if any(isinstance(a, nn.DoRA) for a in adapters):
        raise CheckpointError(f"{where}: a DoRA adapter over part of a fused projection; load the model with its "
                              "projections separate (fused_projections=False)")
    dtype = _dtype(adapters[0])
    if all(isinstance(a, nn.LoRA) and a.mid is None for a in adapters):
        rank = sum(a.rank for a in adapters)
        down = np.concatenate([np.asarray(a.down) for a in adapters], axis=0)
        up = np.zeros((shape[0], rank), dtype)
        has_bias = any(a.bias is not None for a in adapters)
        bias = np.zeros((shape[0],), dtype) if has_bias else None
        col = 0
        for row, a in pieces:
            up[row:row + a.shape[0], col:col + a.rank] = np.asarray(a.up)
            if a.bias is not None:
                bias[row:row + a.shape[0]] = np.asarray(a.bias)
            col += a.rank
        return nn.LoRA(axes, tuple(shape), down, up, None, bias)
    diff = np.zeros(shape, np.float32)
    diff_b = None
    for row, a in pieces:
        diff[row:row + a.shape[0]] = np.asarray(a.delta())
        b = a.delta_bias()
        if b is not None:
            diff_b = np.zeros((shape[0],), np.float32) if diff_b is None else diff_b
            diff_b[row:row + a.shape[0]] = np.asarray(b)
    return nn.Diff(axes, tuple(shape), diff.astype(dtype), None if diff_b is None else diff_b.astype(dtype))


__all__ = ["assemble", "build_adapter", "file_scale", "rows_of"]
