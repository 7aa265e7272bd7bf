"""The torch releases torchloom is tested on, and the one warning for any other.

Imported first by ``torchloom/__init__.py``, before any package touches torch's
private modules: on a release outside the tested range, ``import torchloom``
warns once (naming the range) and goes on; it never raises for the version. The
per-release differences themselves live in each package's ``_torch_compat.py``
(docs/releases.md lists them).
"""

from __future__ import annotations

import re
import warnings

import torch

__all__ = [
    "TESTED_RANGE",
    "TESTED_RELEASES",
    "TorchReleaseWarning",
    "torch_release",
    "untested_torch_message",
    "warn_if_untested_torch",
]

#: The feature releases CI runs (docs/releases.md): the locked one, the ones between, the newest.
#: 2.12 is inside the declared range (no warning) but runs nowhere, so it is not listed.
TESTED_RELEASES: tuple[tuple[int, int], ...] = ((2, 11), (2, 13), (2, 14), (2, 15))
#: The same range as the packages' metadata declares it.
TESTED_RANGE = "torch>=2.11,<2.16"


class TorchReleaseWarning(UserWarning):
    """torchloom was imported with a torch release outside the tested range."""


def torch_release(version: str | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of ``version`` (default: the installed torch); ``None`` if unparsable."""
    text = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        return None
    return (int(match.group(1)), int(match.group(2)))


def untested_torch_message(version: str | None = None) -> str | None:
    """The warning for ``version`` (default: the installed torch), or ``None`` when tested.

    A pre-release or nightly of the release after the newest tested one
    (``2.16.0.dev...``) is outside the range too.
    """
    text = str(torch.__version__ if version is None else version)
    release = torch_release(text)
    if release is not None and TESTED_RELEASES[0] <= release <= TESTED_RELEASES[-1]:
        return None
    return (
        f"torchloom is tested with {TESTED_RANGE} (releases "
        f"{TESTED_RELEASES[0][0]}.{TESTED_RELEASES[0][1]} to "
        f"{TESTED_RELEASES[-1][0]}.{TESTED_RELEASES[-1][1]}); this is torch {text}. "
        "backend='loom' may refuse graphs or fail here; install a torch in that range, "
        "or report what fails."
    )


def warn_if_untested_torch(version: str | None = None) -> bool:
    """Warn (once per import) when torch is outside the tested range; ``True`` if it warned."""
    message = untested_torch_message(version)
    if message is None:
        return False
    warnings.warn(message, TorchReleaseWarning, stacklevel=3)
    return True


warn_if_untested_torch()
