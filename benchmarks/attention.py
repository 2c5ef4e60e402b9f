"""Benchmark every attention implementation available here: forward and forward+backward.

    python benchmarks/attention.py                                  # 1k..32k tokens, head_dim 64/128, f32/bf16
    python benchmarks/attention.py --seq-lens 1024 4096 --head-dims 40 --heads 8 --dtypes float32 --modes fwd

Each row: best-of-``--repeats`` wall time (after a compile and a warm-up run), TFLOP/s, the compiled program's
temporary memory (``memory_analysis().temp_size_in_bytes``: XLA's peak scratch, where the backend reports it), and
the time relative to the best vendor path measured in the same run for the same shape (cuDNN on GPU; the XLA
reference and torch's ``scaled_dot_product_attention`` on the CPU). FLOPs: ``4 * b * h * q * kv * d`` forward
(halved when causal), 3.5x that forward+backward (the backward recomputes the logits: 5 matmuls).
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from eqxdiff.kernels import IMPLEMENTATIONS, AttentionUnavailableError, BlockSizes, attention

VENDOR = {"gpu": ("cudnn",), "cpu": ("xla", "torch-sdpa"), "tpu": ("xla",)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768],
                   help="sequence lengths (q and kv)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--implementations", nargs="+", default=None,
                   help="default: every implementation that can run here, plus torch-sdpa on the CPU")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-dense-gib", type=float, default=4.0,
                   help="skip dense paths (xla, torch-sdpa) whose [b, h, q, kv] float32 logits exceed this")
    p.add_argument("--max-seq-chunked-only", type=int, default=None,
                   help="above this length run only 'chunked' (default: no limit)")
    p.add_argument("--block-q", type=int, default=None, help="block/chunk size along q for chunked and flash")
    p.add_argument("--block-kv", type=int, default=None, help="block/chunk size along kv for chunked and flash")
    return p.parse_args(argv)


def _platform():
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def _best_time(fn, repeats):
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _jax_case(impl, q, k, v, mode, causal, block_sizes):
    options = {} if block_sizes is None or impl not in ("chunked", "flash") else {"block_sizes": block_sizes}

    def fwd(q, k, v):
        return attention(q, k, v, causal=causal, implementation=impl, **options)

    if mode == "fwd":
        fn = jax.jit(fwd)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    compiled = fn.lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    return (lambda: jax.block_until_ready(compiled(q, k, v))), temp


def _torch_case(q, k, v, mode, causal):
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[jnp.dtype(q.dtype).name]
    # torch's preferred [b, h, s, d] layout, made contiguous outside the timed region
    tq, tk, tv = (torch.from_numpy(np.array(x, np.float32)).to(dtype).permute(0, 2, 1, 3).contiguous()
                  for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if mode == "fwd":
        def run():
            with torch.no_grad():
                sdpa(tq, tk, tv, is_causal=causal)
        return run, None
    tq, tk, tv = (t.requires_grad_() for t in (tq, tk, tv))

    def run():
        sdpa(tq, tk, tv, is_causal=causal).float().sum().backward()
    return run, None


def main(argv=None):
    args = parse_args(argv)
    platform = _platform()
    device = jax.devices()[0]
    print(f"# device: {device.device_kind} ({platform}), {jax.device_count()} device(s), jax {jax.__version__}")
    block_sizes = None
    if args.block_q or args.block_kv:
        block_sizes = BlockSizes(block_q=args.block_q or 128, block_kv=args.block_kv or 128)
    names = args.implementations or [n for n in IMPLEMENTATIONS if n not in ("ring", "ulysses")] + (
        ["torch-sdpa"] if platform == "cpu" else [])
    rows = []
    print("| impl | seq | head_dim | dtype | mode | ms | TFLOP/s | temp MiB | vs best vendor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for d in args.head_dims:
            for s in args.seq_lens:
                key = jax.random.key(s * 1000 + d)
                q, k, v = (jax.random.normal(kk, (args.batch, s, args.heads, d), jnp.float32).astype(dtype)
                           for kk in jax.random.split(key, 3))
                dense_gib = args.batch * args.heads * s * s * 4 / 2**30
                for mode in args.modes:
                    results = {}
                    for name in names:
                        dense = name in ("xla", "torch-sdpa")
                        if dense and dense_gib > args.max_dense_gib:
                            continue
                        if args.max_seq_chunked_only and s > args.max_seq_chunked_only and name != "chunked":
                            continue
                        try:
                            if name == "torch-sdpa":
                                run, temp = _torch_case(q, k, v, mode, args.causal)
                            else:
                                run, temp = _jax_case(name, q, k, v, mode, args.causal, block_sizes)
                        except AttentionUnavailableError:
                            continue
                        results[name] = (_best_time(run, args.repeats), temp)
                    vendor = [results[n][0] for n in VENDOR.get(platform, ()) if n in results]
                    best_vendor = min(vendor) if vendor else None
                    flops = 4 * args.batch * args.heads * s * s * d * (0.5 if args.causal else 1.0)
                    flops *= 1.0 if mode == "fwd" else 3.5
                    for name, (t, temp) in results.items():
                        ratio = f"{t / best_vendor:.2f}x" if best_vendor else "-"
                        mem = "-" if temp is None else f"{temp / 2**20:.0f}"
                        row = f"| {name} | {s} | {d} | {dtype} | {mode} | {t * 1e3:.0f} | {flops / t / 1e12:.3f} | " \
                              f"{mem} | {ratio} |"
                        rows.append(row)
                        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
