"""Output directories written whole or not at all: a hidden temporary sibling, renamed into place.

`prepare`, `save_pretrained` and `export` build their output beside its final path and rename it
when complete, so an interrupted command leaves no half-written directory that looks finished.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from genolong.errors import GenolongError


def write_error(out: Path, err: OSError, flag: str = "--out") -> GenolongError:
    """A one-line error for an output that cannot be written, naming the flag to change."""
    return GenolongError(
        f"could not write the output {str(out)!r} ({err.strerror or err}): check free disk space and permissions there, or choose another {flag}"
    )


def staging_dir(out: Path, flag: str = "--out") -> Path:
    """A new empty directory beside `out` (same file system, so the final rename is atomic).

    mkdtemp makes it private (0700); it gets the permissions any new directory would get under the
    user's umask, since it becomes the output. A place that cannot take it is a GenolongError.
    """
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        raise write_error(out, err, flag) from None
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def settle_permissions(root: Path) -> None:
    """Give `root` and everything in it the modes new files and directories get under the umask.

    Some writers make private files (safetensors writes 0600) and copies keep their source's mode;
    an output others should read gets the ordinary modes before it is renamed into place.
    """
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it is to set it: put it back at once
    os.umask(umask)
    return umask
