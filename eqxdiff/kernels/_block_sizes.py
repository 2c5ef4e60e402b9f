"""``BlockSizes``: the tile sizes of the "flash" kernels (and the chunk sizes of "chunked"), validated."""

import dataclasses
import functools
import logging

logger = logging.getLogger("eqxdiff.kernels")

# Smallest (q, kv) block per platform: Triton dots need 16 rows; on TPU the kv block is the lane axis (128) of the
# logits tile; the CPU runs the kernels in interpret mode, where any size works.
_MIN_BLOCK = {"gpu": (16, 16), "tpu": (16, 128), "cpu": (8, 8)}


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes along the query (``block_q*``) and key/value (``block_kv*``) sequences.

    ``block_q``/``block_kv`` tile the forward pass; ``*_dkv`` the backward kernel that makes ``dk, dv`` (one program
    per kv block, looping over q blocks) and ``*_dq`` the one that makes ``dq``. ``None`` means "as the forward".
    Sequences are padded to a multiple of the largest block on each side (padding is masked out), so the smaller
    blocks on a side must divide the largest one. Use :meth:`default` for the per-platform defaults.
    """

    block_q: int = 128
    block_kv: int = 128
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in ("block_q", "block_kv"):
                object.__setattr__(self, f.name, self.block_q if f.name in self.q_fields else self.block_kv)
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{f.name} must be a positive int, got {value!r}")
        for side, names in (("q", self.q_fields), ("kv", self.kv_fields)):
            largest = max(getattr(self, n) for n in names)
            for n in names:
                if largest % getattr(self, n):
                    raise ValueError(f"BlockSizes.{n}={getattr(self, n)} must divide the largest {side} block "
                                     f"{largest}: the {side} sequence is padded to a multiple of it")

    q_fields = ("block_q", "block_q_dkv", "block_q_dq")
    kv_fields = ("block_kv", "block_kv_dkv", "block_kv_dq")

    @property
    def q_multiple(self) -> int:
        return max(getattr(self, n) for n in self.q_fields)

    @property
    def kv_multiple(self) -> int:
        return max(getattr(self, n) for n in self.kv_fields)

    @classmethod
    def default(cls, platform: str, implementation: str = "flash") -> "BlockSizes":
        """Defaults for ``implementation`` ("flash" or "chunked") on ``platform`` ("gpu", "tpu", "cpu"). On GPU the
        flash kernels halve them where they would not fit in shared memory (``_flash._fit_shared_memory``)."""
        if implementation == "chunked":
            # CPU: 256 x 512 tiles (for all batch x heads at once): smaller tiles pay XLA's per-iteration loop
            # overhead more often, larger ones fall out of cache (benchmarks/attention.py, [2, 4096, 8, 40]).
            return cls(block_q=256, block_kv=512) if platform == "cpu" else cls(block_q=512, block_kv=2048)
        if platform == "gpu":  # Triton on an H100: a 128 x 128 forward tile (benchmarks/RESULTS.md), 64 x 64 backward
            return cls(block_q=128, block_kv=128, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
        if platform == "tpu":
            return cls(block_q=512, block_kv=512)
        return cls(block_q=64, block_kv=64)  # interpret mode

    def check_platform(self, platform: str) -> None:
        """Raise ``ValueError`` if a block size cannot be lowered on ``platform``."""
        min_q, min_kv = _MIN_BLOCK.get(platform, _MIN_BLOCK["cpu"])
        for names, least in ((self.q_fields, min_q), (self.kv_fields, min_kv)):
            for n in names:
                b = getattr(self, n)
                if platform == "gpu" and (b & (b - 1) or b < least):
                    raise ValueError(f"BlockSizes.{n}={b}: Triton needs a power of two >= {least} on GPU")
                if platform == "tpu" and b % least:
                    raise ValueError(f"BlockSizes.{n}={b} must be a multiple of {least} on TPU")

    def fit(self, q_len: int, kv_len: int, platform: str) -> "BlockSizes":
        """These sizes shrunk so that no block is (much) longer than its sequence, e.g. 77 text tokens.

        Each block is capped at the next power of two of its sequence length (at least the platform's smallest
        block); one log line says what changed.
        """
        min_q, min_kv = _MIN_BLOCK.get(platform, _MIN_BLOCK["cpu"])
        caps = {"q": max(min_q, _next_power_of_2(q_len)), "kv": max(min_kv, _next_power_of_2(kv_len))}
        changes = {}
        for side, names in (("q", self.q_fields), ("kv", self.kv_fields)):
            sizes = {n: min(getattr(self, n), caps[side]) for n in names}
            if any(max(sizes.values()) % s for s in sizes.values()):  # keep the smaller blocks dividing the largest
                sizes = dict.fromkeys(names, caps[side])
            changes.update({n: s for n, s in sizes.items() if s != getattr(self, n)})
        if not changes:
            return self
        fitted = dataclasses.replace(self, **changes)
        _log_fit(self, fitted, q_len, kv_len)
        return fitted


@functools.lru_cache(maxsize=256)
def _log_fit(before: BlockSizes, after: BlockSizes, q_len: int, kv_len: int) -> None:
    changed = ", ".join(f"{f.name} {getattr(before, f.name)}->{getattr(after, f.name)}"
                        for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name))
    logger.info("flash attention: block sizes shrunk for q_seq=%d, kv_seq=%d: %s", q_len, kv_len, changed)
