"""What every model benchmark here shares: both frameworks set up in one process, timings that take turns with
medians, the machine's load, peak memory, relative error, FLOP counts and model FLOP utilisation (MFU).

The scripts import this as ``from _bench import ...``: run as ``python benchmarks/<script>.py``, the script's own
folder is first on ``sys.path``.

How the figures are taken (the device method of this project: warm-up, medians, same-run ratios, peak memory):

- every variant runs once untimed (compilation, autotuning, cuDNN plan caches), then the variants **take turns**
  for ``repeats`` rounds, so a shared machine's changing load falls on all of them alike; the median is reported
  with every run's time, and each ratio divides two medians of the same run;
- a run ends when the device is done (``jax.block_until_ready`` / ``torch.cuda.synchronize``); the clock is the
  host's ``perf_counter``, so a step's time includes its dispatch, as a user's loop pays it;
- the load average (1, 5, 15 minutes) is printed before and after: on the shared CPU a figure taken at a load
  above the core count is doubtful and RESULTS.md says so;
- peak device memory: PyTorch's allocator peak (``max_memory_allocated``) and JAX's (``peak_bytes_in_use``, which
  also counts the GPU autotuner's scratch while compiling) or XLA's own account of one compiled call
  (:func:`compiled_bytes`);
- MFU = model FLOPs per second / the device's dense bf16 peak (:data:`PEAK_BF16_TFLOPS`, datasheet figures); the
  model FLOPs are counted analytically (each script documents its formula) and checked against XLA's cost analysis
  of the compiled step where XLA counts a scanned layer stack in full (see
  :func:`eqxdiff.train.step_flops`).
"""

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Literal

TorchDevice = Literal["auto", "cpu", "cuda"]

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, matched against JAX's / PyTorch's
# device name in this order (the first substring found wins). Measured on this workplace's lent machines
# (/work/.library/device KINDS.md: an 8192^3 bf16 matmul): H100 SXM 798, H200 769-798 TFLOP/s, so ~80% of the
# datasheet is what a perfect matmul-only program reaches there.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4),          # H200 SXM (same GH100 tensor cores and clocks as H100 SXM)
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),          # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device from its name (``jax.devices()[0].device_kind`` or
    ``torch.cuda.get_device_name()``), or ``None`` for a device not in :data:`PEAK_BF16_TFLOPS` (CPUs)."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def mfu(flops: float, seconds: float, device_name: str) -> float | None:
    """Model FLOP utilisation: ``flops / seconds`` over the device's dense bf16 peak (``None`` without a peak)."""
    peak = peak_tflops(device_name)
    return None if peak is None else flops / seconds / (peak * 1e12)


def setup_frameworks(torch_device: TorchDevice, tf32: bool):
    """Set JAX and PyTorch up for one benchmark process; returns ``(torch.device, header line)``.

    Call before anything touches a JAX device. JAX is told not to preallocate 75% of the GPU (unless
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` is set already), so PyTorch in the same process gets the memory it needs.

    ``tf32`` picks the float32 matmul/convolution precision on a GPU, the same in both frameworks. JAX's default
    precision on a GPU already uses TF32 for float32 dots and convolutions on Ampere and newer (H100 included),
    while PyTorch's default is full float32 for matmuls (TF32 for cuDNN convolutions), so without this the two
    would not compute the same thing. On the CPU there is no TF32 and nothing is changed.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import torch

    if torch_device == "auto":
        torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch_device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torch_device='cuda' but this PyTorch ({torch.__version__}) sees no CUDA device; "
                         f"use --torch-device cpu or auto")
    device = torch.device(torch_device)
    platform = jax.devices()[0].platform
    if platform == "gpu":
        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    precision = "tf32" if tf32 else "full float32"
    line = (f"jax {jax.__version__} on {platform} ({jax.devices()[0].device_kind}, float32 matmuls: "
            f"{precision if platform == 'gpu' else 'default'}); torch {torch.__version__} on {device}"
            + (f" ({torch.cuda.get_device_name(device)}, float32 matmuls: {precision})" if device.type == "cuda"
               else f" ({torch.get_num_threads()} threads)") + f"; host {host_cpu()}")
    return device, line


def jax_device_name() -> str:
    import jax

    return jax.devices()[0].device_kind


def on_gpu() -> bool:
    import jax

    return jax.devices()[0].platform == "gpu"


def torch_sync(device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); call before reading a clock."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_runner(fn, device):
    """``fn`` as a timed runner: run under ``torch.no_grad()``, then wait for the device's queued work."""
    import torch

    def run():
        with torch.no_grad():
            out = fn()
        torch_sync(device)
        return out

    return run


def torch_peak_bytes(device) -> int | None:
    """Peak memory PyTorch's allocator has handed out on ``device`` since the start or the last reset."""
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def torch_reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def torch_free(device) -> None:
    """Collect garbage and hand PyTorch's cached GPU blocks back, so that JAX can use them."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def jax_peak_bytes() -> int | None:
    """Peak bytes in use on JAX's first device since the process started (GPU/TPU; the CPU keeps no count)."""
    import jax

    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None


def jax_bytes_in_use() -> int | None:
    """Bytes JAX holds on its first device now (GPU/TPU; ``None`` on the CPU)."""
    import jax

    try:
        return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None


def compiled_bytes(compiled) -> int | None:
    """Device memory one call of a compiled JAX function needs by XLA's own account: arguments, temporaries and
    the outputs that do not reuse a donated argument. Unlike :func:`jax_peak_bytes` it leaves out the scratch
    XLA's GPU autotuner allocates while compiling (on an H100 the SD 1.5 float32 train step's process peak read
    36.8 GiB, PyTorch's 16.2 GiB, with the allocator logging autotuning attempts at 38-52 GiB).
    ``compiled``: what ``jax.jit(f).lower(...).compile()`` or ``eqx.filter_jit(f).lower(...).compile()`` return."""
    try:
        m = getattr(compiled, "compiled", compiled).memory_analysis()
        return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    except Exception:  # noqa: BLE001 - a backend without memory analysis: a report line is not worth a crash
        return None


def compile_variant(label: str, fn, *args):
    """``jax.jit(fn)`` lowered and compiled for ``args``, its compile time printed (and on a GPU, XLA's account of its
    memory); ``None``, with the reason printed, where it cannot be built (an attention implementation this device
    lacks, say): a benchmark's other variants still run."""
    import jax

    t0 = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # e.g. AttentionUnavailableError
        print(f"{label} skipped: {type(e).__name__}: {str(e).splitlines()[0][:500]}")
        return None
    need = compiled_bytes(compiled) if on_gpu() else None
    print(f"{label} compile: {time.perf_counter() - t0:.1f}s"
          + ("" if need is None else f"; XLA's account of one call: {gib(need)} (weights, inputs, temporaries)"))
    return compiled


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_cpu() -> str:
    """The host CPU's model name, architecture and the ISA extensions XLA's and PyTorch's CPU kernels use (AVX2, FMA,
    AVX-512 and its VNNI / bf16 parts, AMX), as ``/proc/cpuinfo`` lists them (Linux; elsewhere the processor name)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown model")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}, {platform.machine()} ({' '.join(isa) or 'no AVX2'})"


def load_average() -> str:
    """The machine's load average (1, 5, 15 minutes) and its core count, as ``uptime`` shows them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def time_interleaved(runners: Mapping[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                     cpu_times: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Wall-clock seconds of each runner: ``warmup`` untimed calls each, then ``repeats`` rounds in which the
    runners take turns. Each runner must return only once its device work is done. ``cpu_times``, if given, is
    filled with each run's process CPU time (all threads; see :func:`report_cpu_times`)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; time at least one run (--repeats 1 or more)")
    for _ in range(warmup):
        for run in runners.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            c0, t0 = time.process_time(), time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
            if cpu_times is not None:
                cpu_times.setdefault(name, []).append(time.process_time() - c0)
    return times


def report_cpu_times(cpu_times: Mapping[str, list[float]], reference: str,
                     wall_times: Mapping[str, list[float]] | None = None) -> None:
    """On the CPU: each variant's median process CPU time (all threads) and its ratio to ``reference``'s, and with
    ``wall_times`` how many cores it kept busy (CPU time / wall time). While other jobs share the cores a run's wall
    time grows by the time it waits for them, its CPU time much less; and a framework that keeps both cores busy on
    a quiet machine loses more to a busy neighbour than one that keeps one busy. So read the wall-time ratio with
    the cores each side used: a ratio is only what a quiet machine gives when both sides used the cores they use
    there. (Threads that spin while they wait count as busy.)"""
    med = {name: statistics.median(ts) for name, ts in cpu_times.items()}
    if reference not in med:
        return
    width = max(map(len, med))
    for name, m in med.items():
        busy = ""
        if wall_times is not None and name in wall_times:
            busy = f", {m / statistics.median(wall_times[name]):.1f} of {os.cpu_count()} cores busy"
        print(f"{name:<{width}} CPU time: median {fmt_seconds(m)}  ({m / med[reference]:.2f}x {reference}{busy})")


def fmt_seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def report_times(times: Mapping[str, list[float]], what: str = "step") -> dict[str, float]:
    """Print each runner's median and runs; returns the medians."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    width = max(map(len, times))
    for name, ts in times.items():
        print(f"{name:<{width}} {what}: median {fmt_seconds(med[name])}  (runs: "
              f"{', '.join(fmt_seconds(t) for t in ts)})")
    return med


def rel_error(got, want) -> float:
    """``max|got - want| / max|want|`` in float64 (this project's relative error)."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"outputs of different shapes: {got.shape} and {want.shape}")
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check_agreement(errors: Mapping[str, float], dtype: str, tolerance: float | None) -> None:
    """Fail (``SystemExit``) when a float32 output differs from diffusers' by more than ``tolerance``: a
    benchmark of a model that computes something else measures nothing. bf16 outputs are printed, not checked
    (random full-size weights amplify bf16 rounding to ~1e-1, see RESULTS.md)."""
    if tolerance is None or dtype != "float32":
        return
    bad = {name: err for name, err in errors.items() if not err <= tolerance}
    if bad:
        raise SystemExit(f"outputs differ from diffusers' beyond --tolerance {tolerance:g}: "
                         + ", ".join(f"{name}: {err:.2e}" for name, err in bad.items()))
