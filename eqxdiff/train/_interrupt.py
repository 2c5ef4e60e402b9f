"""Stopping a run cleanly: Ctrl-C (SIGINT) or SIGTERM ask the loop to stop at the next step boundary, where it saves
a checkpoint and raises :class:`TrainingInterrupted`; a second Ctrl-C aborts at once. The autoencoder stage of a
from-scratch run stops the same way, keeping nothing of itself (it is short: the next run trains it again)."""

import contextlib
import signal
import sys
import threading


class TrainingInterrupted(Exception):
    """Training stopped on a signal at ``step``; the state was saved to ``checkpoint`` (a folder) if not ``None``.
    Run the same command again to resume from it."""

    def __init__(self, step: int, checkpoint, message: str | None = None):
        self.step, self.checkpoint = step, checkpoint
        if message is None:
            where = f"; checkpoint saved in {checkpoint} (run the same command to resume)" if checkpoint else ""
            message = f"training interrupted at step {step}{where}"
        super().__init__(message)


class StopRequest:
    """Set by the signal handlers of :func:`stop_on_signals`; the loop reads :attr:`requested` between steps."""

    def __init__(self):
        self.requested: str | None = None  # the signal's name once one arrived


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM), *,
                    notice: str = "stopping after this step and saving a checkpoint (Ctrl-C again aborts without "
                                  "saving)"):
    """Within the block, the first of ``signals`` sets ``stop.requested`` instead of killing the process and prints
    ``notice`` (what the loop will do); a second SIGINT raises ``KeyboardInterrupt`` as usual. Outside the main
    thread (where Python cannot install handlers) nothing is installed and ``stop.requested`` stays ``None``."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if stop.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.requested = name
        print(f"\n{name}: {notice}", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
