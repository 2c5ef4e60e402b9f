"""Shared test helpers: the parity metric and PyTorch <-> JAX layout conversion."""

import numpy as np


def rel_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the per-model parity metric (<= 1e-4 in float32)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape mismatch: {a.shape} vs {e.shape}"
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def assert_close(actual, expected, tol: float = 1e-4, what: str = "output") -> None:
    err = rel_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def to_jax(t):
    """A torch tensor or numpy array as a jax array (layout unchanged)."""
    import jax.numpy as jnp

    return jnp.asarray(t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t))


def nchw_to_nhwc(t):
    """A torch NCHW tensor (or numpy array) as a channels-last jax array."""
    import jax.numpy as jnp

    return jnp.moveaxis(to_jax(t), 1, -1)


def nhwc_to_nchw(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.asarray(a), -1, 1)))


def randomize_torch(model, seed: int) -> None:
    """Weights ~ 1/sqrt(fan_in); norm scales ~ 1 +- 0.3 and biases ~ 0 +- 0.3, so a wrong mapping shows and every
    layer differs from the others."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
