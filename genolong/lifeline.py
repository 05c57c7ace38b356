"""How a training worker lives and stops: it dies with its parent, and stops only at a safe point.

The local launcher (genolong.train.launch) runs the loop in a spawned worker process. Three rules:

1. **The worker dies with its parent, however the parent dies** (SIGKILL included). On Linux the
   kernel sends the worker SIGTERM when its parent exits (`prctl(PR_SET_PDEATHSIG)`); everywhere,
   a daemon thread also watches the parent's pid and does the same when the worker is
   re-parented. A worker that has not stopped `PARENT_GONE_GRACE_S` seconds later exits hard.
   (PR_SET_PDEATHSIG fires when the *thread* that started the worker exits; the launcher starts
   it from the main thread, which lives as long as the parent.)
2. **One stop request, one signal.** The worker ignores SIGINT: a Ctrl-C in a terminal reaches
   the whole process group, and the parent forwards it exactly once, as SIGTERM, so a stop
   request is never counted twice. SIGTERM (from the parent, a batch scheduler or the kernel's
   parent-death signal) raises KeyboardInterrupt in the worker's main thread, as soon as it runs
   Python again (a backward pass is one call: the stop can wait for it).
3. **No half-written checkpoint.** `uninterruptible()` (around every checkpoint save) holds
   SIGINT and SIGTERM back until the block ends, then delivers them; a *second* signal while it
   is held abandons the block at once (the atomic save removes its temporary directory).

Process exit codes follow the shell: 130 after an interrupt (128 + SIGINT).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

EXIT_INTERRUPTED = 130
PARENT_GONE_GRACE_S = 60.0
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def follow_parent(parent_pid: int, *, grace_s: float = PARENT_GONE_GRACE_S) -> bool:
    """Make this process stop when `parent_pid` exits; returns whether the kernel does it (Linux)."""
    armed = _arm_parent_death_signal()
    watcher = threading.Thread(target=_watch_parent, args=(parent_pid, armed, grace_s), name="genolong-lifeline", daemon=True)
    watcher.start()
    return armed


def _arm_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, kernel_signals: bool, grace_s: float) -> None:
    # Also covers the parent dying before prctl was armed (the worker is re-parented at once).
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    print("genolong: the launching process is gone; the training worker stops", file=sys.stderr, flush=True)
    if not kernel_signals:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(EXIT_INTERRUPTED)


def stop_on_sigterm() -> None:
    """In the worker's main thread: ignore SIGINT (the parent forwards it), SIGTERM -> KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def uninterruptible(what: str = "a checkpoint"):
    """Hold SIGINT/SIGTERM back while the block runs (rule 3); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if held:
            raise KeyboardInterrupt  # the second request: abandon the block now
        held.append(signum)
        print(f"genolong: finishing {what} before stopping (interrupt again to abandon it)", file=sys.stderr, flush=True)

    # An ignored signal stays ignored (the worker's SIGINT: the parent forwards it as SIGTERM).
    watched = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, hold) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        # Delivered to the handler that was in place before the block, as if it arrived now.
        signal.raise_signal(held[0])
