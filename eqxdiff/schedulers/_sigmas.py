"""Noise-level spacings and flow-matching time shifts, on the host in float64 NumPy as diffusers computes them.

Karras, exponential and beta spacings respace a schedule between its smallest and largest sigma; the time shifts
move flow-matching sigmas (``sigma`` in (0, 1]) toward the noisy end: statically (SD3's ``shift``), by a
resolution-dependent ``mu`` (Flux's dynamic shifting, exponential or linear), and stretched to end at a terminal
value (LTX-Video's ``shift_terminal``).
"""

import math

import numpy as np

SHIFT_TYPES = ("exponential", "linear")


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. (2022) noise levels: ``n`` values from ``sigma_max`` down to ``sigma_min`` (float64)."""
    ramp = np.linspace(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """``n`` noise levels from ``sigma_max`` down to ``sigma_min``, evenly spaced in log sigma (float64)."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


def beta_sigmas(sigma_min: float, sigma_max: float, n: int, alpha: float = 0.6, beta: float = 0.6) -> np.ndarray:
    """"Beta Sampling is All You Need" (Lee et al. 2024): ``sigma_min + ppf(1 - i / (n - 1)) * (sigma_max -
    sigma_min)`` with ``ppf`` the Beta(alpha, beta) quantile function, as diffusers' ``_convert_to_beta``."""
    ppf = beta_ppf(1.0 - np.linspace(0, 1, n), alpha, beta)
    return np.array([sigma_min + p * (sigma_max - sigma_min) for p in ppf])


def _betacf(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The continued fraction of the incomplete beta function (modified Lentz), elementwise; it converges fast for
    ``x < (a + 1) / (a + b + 2)``."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = np.ones_like(x)
    d = 1.0 - qab * x / qap
    d = 1.0 / np.where(np.abs(d) < tiny, tiny, d)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / np.where(np.abs(d) < tiny, tiny, d)
            c = 1.0 + aa / c
            c = np.where(np.abs(c) < tiny, tiny, c)
            h = h * d * c
        if np.all(np.abs(d * c - 1.0) < 1e-15):
            break
    return h


def beta_cdf(x: np.ndarray, a: float, b: float) -> np.ndarray:
    """The regularized incomplete beta function ``I_x(a, b)`` (the Beta(a, b) CDF), float64: the continued
    fraction at ``x`` below the mean-ish split, ``1 - I_{1-x}(b, a)`` above it."""
    x = np.clip(np.asarray(x, np.float64), 0.0, 1.0)
    inner = np.clip(x, 1e-300, 1 - 1e-16)
    lower = inner < (a + 1.0) / (a + b + 2.0)
    front = np.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * np.log(inner) + b * np.log1p(-inner))
    cf = _betacf(np.where(lower, inner, 1.0 - inner), np.where(lower, a, b), np.where(lower, b, a))
    out = np.where(lower, front * cf / a, 1.0 - front * cf / b)
    return np.where(x <= 0.0, 0.0, np.where(x >= 1.0, 1.0, out))


def beta_ppf(q: np.ndarray, a: float, b: float) -> np.ndarray:
    """The Beta(a, b) quantile function (float64): bisection on :func:`beta_cdf` to a bracket of 2^-40, then Newton
    steps, each replaced by a bisection step where it would leave the bracket."""
    q = np.asarray(q, np.float64)
    lo, hi = np.zeros_like(q), np.ones_like(q)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        below = beta_cdf(mid, a, b) < q
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    x = 0.5 * (lo + hi)
    log_norm = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    for _ in range(6):
        cdf = beta_cdf(x, a, b)
        lo, hi = np.where(cdf < q, x, lo), np.where(cdf < q, hi, x)
        with np.errstate(divide="ignore", invalid="ignore"):
            newton = x - (cdf - q) / np.exp(log_norm + (a - 1) * np.log(x) + (b - 1) * np.log1p(-x))
        x = np.where((newton > lo) & (newton < hi), newton, 0.5 * (lo + hi))
    return np.where(q <= 0.0, 0.0, np.where(q >= 1.0, 1.0, x))


def respace(kind: str, sigmas: np.ndarray, n: int, sigma_min: float | None = None,
            sigma_max: float | None = None) -> np.ndarray:
    """``n`` sigmas spaced as ``kind`` (``karras``, ``exponential`` or ``beta``) between ``sigma_min`` and
    ``sigma_max``, which default to the last and first entries of ``sigmas`` (diffusers' ``_convert_to_*``)."""
    lo = float(sigmas[-1]) if sigma_min is None else sigma_min
    hi = float(sigmas[0]) if sigma_max is None else sigma_max
    return {"karras": karras_sigmas, "exponential": exponential_sigmas, "beta": beta_sigmas}[kind](lo, hi, n)


def static_shift(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """SD3's time shift ``shift * s / (1 + (shift - 1) * s)``."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def time_shift(kind: str, mu: float, sigmas: np.ndarray, power: float = 1.0) -> np.ndarray:
    """Flux's resolution-dependent shift: ``e^mu / (e^mu + (1/s - 1)^power)`` (``exponential``) or
    ``mu / (mu + (1/s - 1)^power)`` (``linear``)."""
    if kind == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** power)
    return mu / (mu + (1 / sigmas - 1) ** power)


def stretch_to_terminal(sigmas: np.ndarray, terminal: float) -> np.ndarray:
    """Stretch ``1 - sigmas`` so that the last sigma becomes ``terminal`` (LTX-Video's ``shift_terminal``)."""
    one_minus = 1 - sigmas
    if one_minus[-1] == 0:  # diffusers divides by zero here and returns NaN sigmas (and timesteps)
        raise ValueError(f"shift_terminal={terminal} cannot stretch a schedule whose last sigma is 1 (a single step "
                         "from sigma 1, or custom sigmas ending at 1): use at least 2 steps, or shift_terminal=None")
    scale = one_minus[-1] / (1 - terminal)
    return 1 - one_minus / scale


def shift_flow_sigmas(sigmas: np.ndarray, *, dynamic: bool, shift_type: str, mu, shift: float,
                      terminal) -> np.ndarray:
    """Flow-matching sigmas shifted as FlowMatchEuler and UniPC's flow mode shift them: by the resolution (``mu``,
    ``dynamic``) or by a fixed ``shift``, then stretched to ``terminal`` if one is set."""
    sigmas = time_shift(shift_type, mu, sigmas) if dynamic else static_shift(sigmas, shift)
    return stretch_to_terminal(sigmas, terminal) if terminal else sigmas


def dynamic_shift_mu(image_seq_len: int, *, base_seq_len: int = 256, max_seq_len: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """``mu`` for :func:`time_shift` at ``image_seq_len`` latent tokens: linear from ``base_shift`` at
    ``base_seq_len`` to ``max_shift`` at ``max_seq_len`` (diffusers' ``calculate_shift`` in the Flux/SD3
    pipelines)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)
