"""What every launcher's worker runs (genolong.train.launch: the local process; genolong.train.launch_ray:
each Ray actor): the training loop, with whatever happens turned into a picklable result."""

from __future__ import annotations

import traceback

from genolong.errors import GenolongError
from genolong.train.options import TrainOptions


def run_worker(options_dict: dict) -> tuple[str, object]:
    """("ok", records) | ("error", one-line message) | ("crash", traceback) | ("interrupted", None):
    picklable whatever happens."""
    from genolong.train.loop import train

    try:
        return "ok", train(TrainOptions.from_dict(options_dict))
    except GenolongError as err:
        return "error", str(err)
    except KeyboardInterrupt:
        return "interrupted", None
    except Exception:  # noqa: BLE001  (any failure must reach the parent, with its traceback)
        return "crash", traceback.format_exc()
