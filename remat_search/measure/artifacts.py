"""A study's artifacts: what its workers compute once and share, kept as files with Orbax.

The reference every plan's first step is checked against (full remat's first step on fresh
inputs: the gradients it computed, as the optimizer's state carries them, its loss, and the
noise measured on it: ``measure.check``) is saved under
``<storage home>/artifacts/<study>/``, so that a resumed study, a new worker or a worker on
another host sharing that folder checks against the same reference without running it again.
Each is keyed by everything that makes it valid (:func:`reference_key`: the workload's shapes
and program, the device, the compiler, the input seed and the anchor plan), so a stale one is
never used. A reference is written to a folder of its own and then renamed into place, so
workers saving at once never leave a half-written one: the first rename wins, the others' are
dropped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat_search.measure.check import Reference

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

    def load(self, shapes: list[tuple[int, ...]]) -> Reference | None:
        """The saved reference (the carrier leaves' changes, in order, the loss and the noise
        measured on it), or None where none is saved, or it cannot be read, or its leaves are
        not of ``shapes``."""
        import numpy as np
        import orbax.checkpoint as ocp

        from remat_search.measure.check import FirstStep, Noise, Reference

        if not self.path.is_dir():
            return None
        try:
            saved = ocp.StandardCheckpointer().restore(self.path)
            leaves = tuple(np.asarray(saved["gradients"][str(i)], np.float64) for i in range(len(shapes)))
            noise = Noise(
                rounding=tuple(np.asarray(saved["rounding"]).tolist()), rerun=tuple(np.asarray(saved["rerun"]).tolist()),
                unit_roundoff=float(np.asarray(saved["unit_roundoff"])), precision=np.asarray(saved["precision"], np.uint8).tobytes().decode(),
            )
            reference = Reference(FirstStep(leaves, float(np.asarray(saved["loss"]))), noise)
        except Exception:  # noqa: BLE001 - an unreadable artifact is computed again, never trusted
            return None
        if [leaf.shape for leaf in leaves] != [tuple(s) for s in shapes] or len(saved["gradients"]) != len(shapes):
            return None
        return reference

    def save(self, reference: Reference) -> None:
        """Save a reference unless one is there; best effort: a folder that cannot be written
        leaves the study checking against a reference it computes each time."""
        import numpy as np
        import orbax.checkpoint as ocp

        if self.path.exists():
            return
        partial = self.folder / f".{self.path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        noise = reference.noise
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tree = {
                "gradients": {str(i): np.asarray(leaf) for i, leaf in enumerate(reference.step.gradients)},
                "loss": np.asarray(reference.step.loss), "rounding": np.asarray(noise.rounding), "rerun": np.asarray(noise.rerun),
                "unit_roundoff": np.asarray(noise.unit_roundoff), "precision": np.frombuffer(noise.precision.encode(), np.uint8),  # Orbax keeps arrays, not text
            }
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(partial, tree)
            checkpointer.wait_until_finished()
            os.rename(partial, self.path)  # atomic; fails where another worker's is in place
        except Exception:  # noqa: BLE001, S110 - best effort: the reference in memory is used either way
            pass
        finally:
            for left in self.folder.glob(f"{partial.name}*"):  # ours, and Orbax's own temporary folder
                shutil.rmtree(left, ignore_errors=True)


def keep_program(folder: Path, digest: str, text: str) -> None:
    """Keep a compiled program's text as ``folder/<digest>.hlo.gz`` unless it is there: written
    aside and renamed into place, so that workers keeping one at once never leave half a file.
    Best effort: a folder that cannot be written keeps nothing (the measurement stands)."""
    path = folder / f"{digest}.hlo.gz"
    if path.exists():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        aside = folder / f".{digest}.{uuid.uuid4().hex}"
        aside.write_bytes(gzip.compress(text.encode(), mtime=0))
        os.replace(aside, path)
    except OSError:
        return
