"""Benchmark every single-device attention implementation available here: forward and forward+backward.

    python benchmarks/attention.py                       # 1k..32k tokens (64k chunked only), head_dim 64/128, f32/bf16
    python benchmarks/attention.py --seq-lens 1024 4096 --head-dims 40 --heads 8 --dtypes float32 --modes fwd
    python benchmarks/attention.py --dtypes bfloat16 --implementations cudnn flash:mosaic_gpu flash:triton  # GPU

Each row: the best of ``--repeats`` timings (wall clock, or ``--timer process``: CPU time of all threads), each after
an untimed run, TFLOP/s, the compiled program's temporary memory (``memory_analysis()``'s
``temp_size_in_bytes``: XLA's peak scratch, where the backend reports it), and the time relative to the best vendor
path measured in the same run for the same shape (cuDNN on GPU; the XLA reference and torch's
``scaled_dot_product_attention`` on the CPU). FLOPs: ``4 * b * h * q * kv * d`` forward
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
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536],
                   help="sequence lengths (q and kv)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--implementations", nargs="+", default=None,
                   help="default: every implementation that can run here, plus torch-sdpa on the CPU; "
                        "'flash:triton' / 'flash:mosaic_gpu' force flash's forward kernel")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inner", type=int, default=None,
                   help="calls per timing, waiting for the last one only (default: 1 on the CPU, 20 on a GPU)")
    p.add_argument("--timer", choices=["wall", "process"], default="wall",
                   help="wall clock, or the process's CPU time over all threads (steadier on a shared CPU)")
    p.add_argument("--max-dense-gib", type=float, default=4.0,
                   help="skip 'xla' (the dense reference) when its [b, h, q, kv] float32 logits exceed this")
    p.add_argument("--max-seq-all", type=int, default=32768,
                   help="above this sequence length run only 'chunked' (the O(seq)-memory path)")
    p.add_argument("--check", action="store_true",
                   help="also report each implementation's max relative error (output and grads) against the "
                        "float32 'xla' reference on the same inputs (needs the dense logits to fit)")
    p.add_argument("--block-q", type=int, default=None, help="block/chunk size along q for chunked and flash")
    p.add_argument("--block-kv", type=int, default=None, help="block/chunk size along kv for chunked and flash")
    return p.parse_args(argv)


def _platform():
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def _best_times(runners, repeats, clock, inner=1):
    """Best time of each runner over ``repeats`` rounds. Rounds interleave the implementations, so a shared
    machine's changing load hits all alike; in each round a runner first runs untimed, so that the one before it
    (e.g. the dense reference, which allocates gigabytes) does not leave it cold caches and page faults. Each
    timing covers ``inner`` calls issued back to back (on a GPU they queue up, hiding the dispatch cost) and waits
    for the last result only."""
    best = dict.fromkeys(runners, math.inf)
    for _ in range(repeats):
        for name, run in runners.items():
            jax.block_until_ready(run())
            t = clock()
            for _ in range(inner):
                out = run()
            jax.block_until_ready(out)
            best[name] = min(best[name], (clock() - t) / inner)
    return best


def _jax_fn(impl, mode, causal, block_sizes):
    """``f(q, k, v, cotangent)``: the output ("fwd"), or the output and its vjp with ``cotangent`` ("fwd+bwd").
    ``impl`` may name a flash forward kernel: "flash:triton", "flash:mosaic_gpu" (plain "flash" picks one)."""
    impl, _, backend = impl.partition(":")
    options = {} if block_sizes is None or impl not in ("chunked", "flash") else {"block_sizes": block_sizes}
    if backend:
        options["flash_backend"] = backend

    def fwd(q, k, v):
        return attention(q, k, v, causal=causal, implementation=impl, **options)

    def fn(q, k, v, cotangent):
        if mode == "fwd":
            return fwd(q, k, v)
        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(cotangent)

    return jax.jit(fn)


def _jax_case(impl, args, mode, causal, block_sizes):
    compiled = _jax_fn(impl, mode, causal, block_sizes).lower(*args).compile()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    return (lambda: compiled(*args)), temp, compiled


def _max_rel_error(actual, expected):
    """max over outputs of max |a - e| / max |e|, against the float32 reference."""
    errors = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - e)) / jnp.maximum(jnp.max(jnp.abs(e)), 1e-30))
              for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected))]
    return max(errors)


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


def _config_rows(args, names, platform, block_sizes, clock, dtype, d, s, mode):
    """Measure every implementation at one shape; return the table rows."""
    key = jax.random.key(s * 1000 + d)
    q, k, v, cotangent = (jax.random.normal(kk, (args.batch, s, args.heads, d), jnp.float32).astype(dtype)
                          for kk in jax.random.split(key, 4))
    dense_gib = args.batch * args.heads * s * s * 4 / 2**30
    expected = None
    if args.check and dense_gib <= args.max_dense_gib:
        expected = _jax_fn("xla", mode, args.causal, None)(*(x.astype(jnp.float32) for x in (q, k, v, cotangent)))
    runners, temps, errors = {}, {}, {}
    for name in names:
        if (name == "xla" and dense_gib > args.max_dense_gib) or (s > args.max_seq_all and name != "chunked"):
            continue
        try:
            if name == "torch-sdpa":
                runners[name], temps[name] = _torch_case(q, k, v, mode, args.causal)
                continue
            runners[name], temps[name], compiled = _jax_case(name, (q, k, v, cotangent), mode, args.causal,
                                                             block_sizes)
        except AttentionUnavailableError:
            continue
        if expected is not None:
            errors[name] = _max_rel_error(compiled(q, k, v, cotangent), expected)
    times = _best_times(runners, args.repeats, clock, args.inner or (20 if platform == "gpu" else 1))
    vendor = [times[n] for n in VENDOR.get(platform, ()) if n in times]
    best_vendor = min(vendor) if vendor else None
    flops = 4 * args.batch * args.heads * s * s * d * (0.5 if args.causal else 1.0) * (1.0 if mode == "fwd" else 3.5)
    rows = []
    for name, t in times.items():
        ratio = f"{t / best_vendor:.2f}x" if best_vendor else "-"
        mem = "-" if temps[name] is None else f"{temps[name] / 2**20:.0f}"
        row = f"| {name} | {s} | {d} | {dtype} | {mode} | {t * 1e3:.1f} | {flops / t / 1e12:.3f} | {mem} | {ratio} |"
        if args.check:
            row += f" {errors[name]:.1e} |" if name in errors else " - |"
        rows.append(row)
    return rows


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
    clock = time.perf_counter if args.timer == "wall" else time.process_time
    check = " err vs f32 xla |" if args.check else ""
    print(f"| impl | seq | head_dim | dtype | mode | ms ({args.timer}) | TFLOP/s | temp MiB | vs best vendor |{check}")
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.check else ""))
    rows = []
    for dtype in args.dtypes:
        for d in args.head_dims:
            for s in args.seq_lens:
                for mode in args.modes:
                    for row in _config_rows(args, names, platform, block_sizes, clock, dtype, d, s, mode):
                        rows.append(row)
                        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
