"""The storage is an extension point with two backends, SQLite (embedded) and PostgreSQL (several
hosts): the same tests of what remat-search keeps in it run against both. The queries' reader
has its own shared suite (tests/report/test_reader.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from remat_search.errors import StorageError
from remat_search.measure.device import DeviceInfo
from remat_search.measure.measurement import MEASUREMENT_SCHEMA
from remat_search.store import cache
from remat_search.store.attributes import LAYERS_ATTR
from remat_search.store.reading import read_only
from remat_search.store.storage import check_storage, load_study, open_storage

from tests.conftest import create_database

CPU = DeviceInfo(
    target="local", platform="cpu", device_kind="cpu", device_count=1, mesh=None, memory_limit=None, executes=True,
    jax_version="0.10.2", workload_fingerprint="w", program_fingerprint="p", measurement_schema=MEASUREMENT_SCHEMA,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new, empty database of each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'studies.db'}"
    else:
        yield create_database(request.getfixturevalue("postgres_server"), "t_" + request.node.originalname[5:45])


def test_a_study_written_through_optuna_is_read_back_by_both_paths(url: str) -> None:
    """open_storage makes optuna's tables; optuna loads what it wrote, and the queries'
    read-only connection reads the same rows without optuna."""
    check_storage(url, create=True)
    storage = open_storage(url, create=True)
    study = optuna.create_study(study_name="s", storage=storage, directions=["minimize", "minimize"])
    study.set_user_attr(LAYERS_ATTR, 4)
    study.add_trial(optuna.trial.create_trial(values=[1.0, 2.0]))
    again = load_study("s", open_storage(url))
    assert again.user_attrs[LAYERS_ATTR] == 4 and len(again.trials) == 1
    with read_only(url) as reader:
        assert reader.rows("SELECT study_name FROM studies") == [("s",)]
    with pytest.raises(StorageError, match=r"no study 'missing' in .*; studies there: \['s'\]"):
        load_study("missing", open_storage(url))


def test_a_failed_statement_is_one_line_naming_the_storage(url: str) -> None:
    """Both backends' errors are translated in one place (store.storage.translate_errors), the
    read-only connection's too: one line, the URL and the database's own reason."""
    open_storage(url, create=True)
    with (
        pytest.raises(StorageError, match=r"^storage: cannot use '.*' \(.*no_such_table") as raised,
        read_only(url) as reader,
    ):
        reader.rows("SELECT * FROM no_such_table")
    assert "\n" not in str(raised.value)


def test_a_plan_is_claimed_by_one_trial_at_a_time(url: str) -> None:
    engine = open_storage(url, create=True).engine
    cache.create_table(engine)
    assert cache.claim(engine, CPU, "digest", study="s", trial=0) is None
    assert cache.claim(engine, CPU, "digest", study="s", trial=0) is None  # ours already
    assert cache.claim(engine, CPU, "digest", study="t", trial=3) == ("s", 0)
    cache.release(engine, CPU, "digest", study="t", trial=3)  # not the holder: nothing
    assert cache.claim(engine, CPU, "digest", study="t", trial=3) == ("s", 0)
    cache.release(engine, CPU, "digest", study="s", trial=0)
    assert cache.claim(engine, CPU, "digest", study="t", trial=3) is None


def test_a_study_is_confirmed_by_one_holder_at_a_time(url: str) -> None:
    """The other waits for the holder's beat up to a grace no loaded host's thread comes near
    (its wait ends at the first beat): whatever the host's speed, a live holder keeps it."""
    engine = open_storage(url, create=True).engine
    cache.create_table(engine)
    with cache.confirmation_claim(engine, "s", interval=0.05, grace=120.0) as holder:
        assert holder is None  # this process holds it
        seen: list[str | None] = []

        def other() -> None:
            with cache.confirmation_claim(engine, "s", interval=0.05, grace=120.0) as theirs:
                seen.append(theirs)

        waiting = threading.Thread(target=other)
        waiting.start()
        waiting.join(150)  # past the grace: it has seen a beat, or given up
        assert seen and seen[0] is not None  # held: left to the holder
    with cache.confirmation_claim(engine, "s", interval=0.05, grace=120.0) as holder:
        assert holder is None  # given back at the end of the block
