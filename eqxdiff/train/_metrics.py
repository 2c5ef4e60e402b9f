"""Training metrics to the console (a tqdm progress bar), a JSONL file and TensorBoard event files."""

import json
import time
from pathlib import Path

import numpy as np

from ..pipelines import write_video

FILMSTRIP_FRAMES = 8  # frames of each sample video in its PNG and TensorBoard image


def log_line(message: str) -> None:
    """A run's console line, with the time: ``[12:34:56] message``."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def step_flops(compiled) -> float | None:
    """FLOPs of one compiled step on one device, from XLA's cost analysis (``None`` if the backend has none).
    ``compiled`` is what ``eqx.filter_jit(f).lower(...).compile()`` or ``jax.jit(f).lower(...).compile()`` return (or
    the lowered step: XLA's count without compiling). XLA counts a ``while`` loop's body once, whatever its trip
    count, so layers run under ``lax.scan`` (``scan_layers``) or chunked attention are under-counted."""
    try:
        cost = getattr(compiled, "compiled", compiled).cost_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = None if not cost else cost.get("flops")
    return float(flops) if flops and flops > 0 else None


class MetricsLogger:
    """Writes each logged step to ``metrics.jsonl`` and TensorBoard (``tensorboard/``) under ``folder`` (either may
    be off), and shows a progress bar with the latest loss."""

    def __init__(self, folder: Path | None, *, total_steps: int, start_step: int = 0, jsonl: bool = True,
                 tensorboard: bool = True, progress: bool = True):
        self.folder = None if folder is None else Path(folder)
        self.jsonl = self.writer = self.bar = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            if jsonl:
                self.jsonl = open(self.folder / "metrics.jsonl", "a", encoding="utf-8")
            if tensorboard:
                from tensorboardX import SummaryWriter

                self.writer = SummaryWriter(str(self.folder / "tensorboard"))
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.last = start_step

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": int(step), "time": time.time(),
               **{k: float(np.asarray(v)) for k, v in metrics.items() if v is not None}}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for k, v in row.items():
                if k not in ("step", "time"):
                    self.writer.add_scalar(f"train/{k}", v, int(step))
        if self.bar is not None:
            self.bar.update(int(step) - self.last)
            self.bar.set_postfix(loss=f"{row.get('loss', float('nan')):.4f}",
                                 sps=f"{row.get('samples_per_second', 0.0):.1f}")
        self.last = int(step)

    def images(self, step: int, tag: str, images: np.ndarray, fps: float | None = None) -> None:
        """uint8 samples under ``samples/``: images ``[n, h, w, 3]`` as a PNG grid, also in TensorBoard; videos ``[n,
        frames, h, w, 3]`` as an MP4 of each frame's grid at ``fps`` (``None``: the writer's default), and a PNG (also
        in TensorBoard) of up to 8 evenly spaced frames of each video, one video a row."""
        if self.folder is None:
            return
        from PIL import Image

        images = np.asarray(images)
        folder, name = self.folder / "samples", f"{tag}_{int(step):07d}"
        folder.mkdir(exist_ok=True)
        if images.ndim == 5:
            frames = np.stack([image_grid(images[:, f]) for f in range(images.shape[1])])
            write_video(frames, folder / f"{name}.mp4", **({} if fps is None else {"fps": fps}))
            picks = np.unique(np.linspace(0, images.shape[1] - 1, min(images.shape[1], FILMSTRIP_FRAMES)).round())
            grid = image_grid(images[:, picks.astype(int)].reshape(-1, *images.shape[2:]), columns=len(picks))
        else:
            grid = image_grid(images)
        Image.fromarray(grid).save(folder / f"{name}.png")
        if self.writer is not None:
            self.writer.add_image(f"samples/{tag}", grid, int(step), dataformats="HWC")

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        for f in (self.jsonl, self.writer, self.bar):
            if f is not None:
                f.close()


def image_grid(images: np.ndarray, columns: int | None = None, pad: int = 1) -> np.ndarray:
    """uint8 ``[n, h, w, c]`` images tiled into one ``[rows*(h+pad)+pad, cols*(w+pad)+pad, c]`` image."""
    images = np.asarray(images)
    n, h, w, c = images.shape
    cols = columns or int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / cols))
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 255, np.uint8)
    for i, img in enumerate(images):
        r, q = divmod(i, cols)
        grid[pad + r * (h + pad):pad + r * (h + pad) + h, pad + q * (w + pad):pad + q * (w + pad) + w] = img
    return grid
