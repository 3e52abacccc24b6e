"""Where studies live by default: the storage home and the default storage URL.

The spec reads this for ``storage``'s default; the store opens what it names.
"""

from __future__ import annotations

import os
from pathlib import Path

STORAGE_ENV = "REMAT_SEARCH_STORAGE"
HOME_ENV = "REMAT_SEARCH_HOME"


def storage_home() -> Path:
    """Where studies and caches live by default, whatever the working directory:
    ``$REMAT_SEARCH_HOME``; else the ``storage/`` folder of the source checkout remat-search
    runs from (``pip install -e .``); else ``~/.local/share/remat-search``."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]  # remat_search/store/location.py
    if (checkout / "pyproject.toml").is_file() and (checkout / "storage").is_dir():
        return checkout / "storage"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "remat-search"


def default_storage() -> str:
    """The default storage URL: ``studies.db`` in :func:`storage_home`."""
    return f"sqlite:///{storage_home() / 'studies.db'}"
