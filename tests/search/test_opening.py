"""Opening a study is one path for `run` and `submit` (search.opening): what the storage holds
of the study is checked before anything is built, compiled or written."""

from __future__ import annotations

import pytest

import remat_search
from remat_search import SpecError
from remat_search.spec.loading import parse_spec

from tests.conftest import spec_dict


@pytest.mark.parametrize("enter", [remat_search.submit, remat_search.run], ids=["submit", "run"])
def test_another_identity_is_refused_before_the_workload_is_built(storage_url: str, enter) -> None:  # type: ignore[no-untyped-def]
    """The study is stored with the tiny transformer; a spec of the same name whose workload
    does not even build is refused for its other workload, not for the build: the study's
    identity is read first, so neither `submit` nor `run` builds (or starts a worker for) a
    workload the study would refuse."""
    remat_search.submit(parse_spec(spec_dict(storage_url, trials=1)))
    other = parse_spec(spec_dict(storage_url, trials=1, workload={"factory": "tests.factories:not_a_workload"}))
    with pytest.raises(SpecError, match="^spec.workload: study 'tiny' already exists with another workload"):
        enter(other)
