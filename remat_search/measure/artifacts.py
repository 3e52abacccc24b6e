"""A study's artifacts: what its workers compute once and share, kept as files with Orbax.

The reference every plan's first step is checked against (full remat's first step on fresh
inputs: the change it makes to each array of the training state, and its loss) is saved under
``<storage home>/artifacts/<study>/``, so that a resumed study, a new worker or a worker on
another host sharing that folder checks against the same reference without running it again.
Each is keyed by everything that makes it valid (:func:`reference_key`: the workload's shapes
and program, the device, the compiler, the input seed and the anchor plan), so a stale one is
never used. A reference is written to a folder of its own and then renamed into place, so
workers saving at once never leave a half-written one: the first rename wins, the others' are
dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARTIFACTS = "artifacts"
"""The folder of the storage home (``store.location.storage_home``) that holds each study's artifacts."""
PROGRAMS = "programs"
"""The folder of a study's artifacts that keeps each compiled program's text, by its digest
(``<digest>.hlo.gz``): what ``remat-search calibrate --study`` fits the step-time model on."""


def reference_key(parts: dict[str, Any]) -> str:
    """A short hash of what a reference depends on (``parts``, JSON-serialisable)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ReferenceStore:
    """Where one study keeps its reference first step for one setting (``key``)."""

    folder: Path
    key: str

    @property
    def path(self) -> Path:
        """The saved reference's Orbax checkpoint folder."""
        return self.folder / f"reference-{self.key}"

    def load(self, shapes: list[tuple[int, ...]]) -> tuple[list[Any], float] | None:
        """The saved reference (the state change's leaves, in order, and the loss), or None where
        none is saved, or it cannot be read, or its leaves are not of ``shapes``."""
        import numpy as np
        import orbax.checkpoint as ocp

        if not self.path.is_dir():
            return None
        try:
            saved = ocp.StandardCheckpointer().restore(self.path)
            leaves = [np.asarray(saved["change"][str(i)]) for i in range(len(shapes))]
            loss = float(np.asarray(saved["loss"]))
        except Exception:  # noqa: BLE001 - an unreadable artifact is computed again, never trusted
            return None
        if [leaf.shape for leaf in leaves] != [tuple(s) for s in shapes] or len(saved["change"]) != len(shapes):
            return None
        return leaves, loss

    def save(self, leaves: list[Any], loss: float) -> None:
        """Save a reference (leaves on the host) unless one is there; best effort: a folder that
        cannot be written leaves the study checking against a reference it computes each time."""
        import numpy as np
        import orbax.checkpoint as ocp

        if self.path.exists():
            return
        partial = self.folder / f".{self.path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tree = {"change": {str(i): np.asarray(leaf) for i, leaf in enumerate(leaves)}, "loss": np.asarray(loss)}
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(partial, tree)
            checkpointer.wait_until_finished()
            os.rename(partial, self.path)  # atomic; fails where another worker's is in place
        except Exception:  # noqa: BLE001, S110 - best effort: the reference in memory is used either way
            pass
        finally:
            for left in self.folder.glob(f"{partial.name}*"):  # ours, and Orbax's own temporary folder
                shutil.rmtree(left, ignore_errors=True)
