"""Bad input, fuzzed: malformed specs, budgets, storage URLs, study names and plan JSON.

Each input drives the real CLI in this process (or, for plan JSON, which no command reads
from a user, :meth:`RematPlan.from_json`). Each must end in exit 2 with one line naming the
field, or in a valid run (exit 0, or 1 for "nothing fits"): never a traceback, never an
unexpected exception (exit 3 "unexpected"), and the real study's database file unchanged.
``benchmarks/fuzz.py`` runs the same strategies over ≥ 1,000 inputs and prints the table.

Sizes that would make a *valid* search long (layers, widths, trials, repeats) are drawn
small; huge and negative numbers go everywhere else, and invalid ones everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from remat_search.cli import output
from remat_search.cli.app import app
from remat_search.errors import SpecError
from remat_search.plans.plan import RematPlan
from remat_search.spec.fields import STUDY_NAME_PATTERN

from tests.conftest import write_spec

pytestmark = pytest.mark.slow  # fuzzes bad input through the CLI

STUDY = "fuzzed"
CHEAP_MLP = {"kind": "mlp", "layers": 1, "width": 8, "hidden": 8, "batch": 2}


def base_spec(storage: str) -> dict[str, Any]:
    """A valid spec whose search is as short as a real one gets (one compile, one timed step)."""
    return {
        "study": "fz",
        "storage": storage,
        "workload": dict(CHEAP_MLP),
        "space": {"layout": "uniform", "choices": ["full"]},
        "budget": "1GiB",
        "trials": 1,
        "sampler": {"kind": "random", "seed": 0},
        "timing": {"warmup": 0, "repeats": 1, "anchor": False},
        "confirm": {"top": 0},
        "compilation_cache": None,
    }


# --- values -------------------------------------------------------------------------------
text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=24)
"""Any text a file or an argv can hold (no lone surrogates; argv has no NUL)."""
huge_ints = st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, 10**400])
numbers = st.one_of(
    st.integers(-(2**70), 2**70), huge_ints, st.integers(-5, 5).map(lambda n: -n),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 0.5, -0.0, 1e308, -1e308]),
)
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=6,
)
"""A value of any YAML type, nested a little."""
small_or_bad = st.one_of(st.integers(-3, 3), junk)
"""For sizes: valid only when small, so a valid search stays short."""

UNITS = ["", "B", "b", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "KB", "MB", "GB", "gb", "gib", " GiB", "Gb",
         "bits", "%", "kB", "iB", " ", "GiB GiB", "ＧｉＢ"]
budgets = st.one_of(
    text,
    st.builds(lambda n, u: f"{n}{u}", st.one_of(numbers, st.sampled_from(["1.5", ".5", "1.", "1e3", "1E+3", "-0",
                                                                          "nan", "inf", "1_000", "0x10", "１２", "٣"])),
              st.sampled_from(UNITS)),
    st.sampled_from(["", " ", "1e999", "-inf", "1,5GiB", "1.5.5GiB", "GiB", "16 GiBs", "1e-300", "0.5", "1e20PiB"]),
)

SAMPLERS = ["planner", "tpe", "nsga2", "random", "cmaes", "grid", "TPE", "", "ｔｐｅ", "qmc", "gp", "bruteforce"]
FACTORIES = [
    "tests.factories:failing_factory", "tests.factories:not_a_workload", "tests.factories:nope",
    "tests.factories:plain_function", "no_such_module_x:make", "json:loads", "math:sqrt", "os.path:join",
    "tests.factories", ":make", "a:b:c", "tests.factories:", "1abc:make", "tests..factories:make", "ü:make",
]
factories = st.one_of(st.sampled_from(FACTORIES), text, text.map(lambda t: f"no_such_{abs(hash(t))}:{t}"))
POLICY_CHOICES = ["none", "full", "dots", "dots_no_batch", "names", "offload", "fulll", "",
                  {"label": "x", "names": ["mlpwi"]}, {"label": "y", "offload": ["mlpwo"]},
                  {"label": "z", "names": []}, {"label": "bad label", "names": ["mlpwi"]},
                  {"label": "w", "names": ["mlpwi"], "offload": ["mlpwo"]}, {"label": "v", "names": "mlpwi"},
                  {"label": "u", "names": ["no_such_tensor"]}, {"names": ["mlpwi"]}, {"label": "t", "policy": "full"}]
TARGETS = ["local", "tpu", "gpu", {"platform": "tpu", "topology": "v5e:1x1"}, {"platform": "tpu", "topology": "v5e"},
           {"platform": "tpu", "topology": "v99z:1x1"}, {"platform": "gpu", "topology": "h100"}, {"platform": "tpu"},
           {"platform": "tpu", "topology": "v5e:0x0"}, {"platform": "tpu", "topology": "v5e:1x1", "extra": 1}]
MESHES = [{"data": 1}, {"data": 2}, {"fsdp": 2}, {"data": 0}, {"data": -1}, {"model": 2}, {"data": 2**40},
          {"data": "two"}, [], "data", {"data": 1, "fsdp": 1}]
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    # path in the spec → the values it is fuzzed with (anything else: `junk`)
    "study": st.one_of(text, st.from_regex(STUDY_NAME_PATTERN, fullmatch=True)),
    "storage": st.one_of(text, st.sampled_from(["sqlite://", "sqlite:///", "sqlite:////no/such/dir/x.db",
                                                "postgresql://u@127.0.0.1:1/db", "nosuch://x", "not a url"])),
    "budget": st.one_of(budgets, numbers, junk),
    "trials": small_or_bad,
    "workload": st.one_of(junk, st.fixed_dictionaries({"kind": st.one_of(st.sampled_from(["transformer", "mlp", "cnn",
                                                                                          "MLP", ""]), junk)})),
    "workload.kind": st.one_of(st.sampled_from(["transformer", "mlp", "cnn", "MLP", "", "factory"]), junk),
    "workload.factory": factories,
    "workload.args": junk,
    "workload.layers": small_or_bad, "workload.width": small_or_bad, "workload.hidden": small_or_bad,
    "workload.batch": small_or_bad, "workload.dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "int8"]), junk),
    "workload.scan": junk,
    "space": junk,
    "space.layout": st.one_of(st.sampled_from(["uniform", "per_layer", "segments", "nested", ""]), junk),
    "space.segments": st.one_of(small_or_bad, st.lists(small_or_bad, max_size=3)),
    "space.nested": junk,
    "space.choices": st.one_of(junk, st.lists(st.one_of(st.sampled_from(POLICY_CHOICES), junk), max_size=3)),
    "sampler": junk,
    "sampler.kind": st.one_of(st.sampled_from(SAMPLERS), junk),
    "sampler.seed": st.one_of(numbers, junk),
    "timing": junk,
    "timing.warmup": small_or_bad, "timing.repeats": small_or_bad,
    "timing.timeout": st.one_of(numbers, st.builds(lambda n, u: f"{n}{u}", numbers, st.sampled_from(
        ["", "s", "ms", "m", "min", "h", "d", " s", "sec"])), junk),
    "timing.anchor": junk,
    "confirm": junk, "confirm.top": st.one_of(st.just(0), junk), "confirm.rounds": small_or_bad,
    "confirm.presets": junk,
    "gradient_tolerance": st.one_of(numbers, junk),
    "prescreen": st.one_of(numbers, junk),
    "compilation_cache": st.one_of(st.none(), junk),
    "target": st.one_of(st.sampled_from(TARGETS), junk),
    "mesh": st.one_of(st.sampled_from(MESHES), junk),
}


@st.composite
def specs(draw: Any, storage: str) -> Any:
    """A malformed spec: the cheap valid one with 1-3 edits (a field set to a fuzzed value, a
    field removed, an unknown key, a section replaced), or, now and then, no mapping at all."""
    kind = draw(st.sampled_from(["edits"] * 8 + ["yaml text", "not a mapping"]))
    if kind == "yaml text":
        return draw(text)
    if kind == "not a mapping":
        return draw(st.one_of(st.lists(junk, max_size=3), numbers, st.none(), st.booleans()))
    spec = copy.deepcopy(base_spec(storage))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(sorted(FIELDS)))
        action = draw(st.sampled_from(["set"] * 6 + ["delete", "unknown key"]))
        *parents, key = path.split(".")
        where = spec
        for p in parents:
            where = where.setdefault(p, {}) if isinstance(where, dict) else {}
        if not isinstance(where, dict):
            continue
        if action == "set":
            where[key] = draw(FIELDS[path])
        elif action == "delete":
            where.pop(key, None)
        else:
            where[draw(text)] = draw(junk)
    return spec


STORAGE_URLS = [
    "sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite:////no/such/dir/x.db", "sqlite:///relative.db",
    "sqlite:///{tmp}", "sqlite:///{tmp}/new.db", "sqlite:///{tmp}/notadb.txt", "sqlite:///{real}",
    "sqlite:///{real}?timeout=abc", "sqlite:///{real}?mode=ro", "sqlite:///{real}?uri=true", "sqlite:///{real}/x",
    "sqlite+pysqlite:///{real}", "sqlite+nosuch:///{real}", "postgresql://u@127.0.0.1:1/db",
    "postgresql+psycopg://u:p@localhost:1/db", "postgresql://u@localhost:notaport/db", "postgresql://u:p@[::1",
    "postgresql+asyncpg://u@127.0.0.1/db", "mysql://u@127.0.0.1:1/db", "oracle://u@127.0.0.1:1/db",
    "mssql+pyodbc://u@127.0.0.1:1/db", "nosuch://x", "http://127.0.0.1:1/", "not a url", "", "://", "sqlite:",
    "SQLITE:///{tmp}/x.db", "sqlite:///{tmp}/é ü.db", "sqlite:///{tmp}/{x}.db", "sqlite:///{tmp}/{{.db", "sqlite:////dev/null", "sqlite:////proc/self/status",
]
storage_urls = st.one_of(
    st.sampled_from(STORAGE_URLS),
    text,
    st.builds(lambda s, t: f"{s}{t}", st.sampled_from(["sqlite:///", "sqlite:////", "postgresql://", "mysql://",
                                                       "sqlite:///{tmp}/", "postgresql://u@127.0.0.1:1/"]), text),
)
study_names = st.one_of(st.just(STUDY), text, st.from_regex(STUDY_NAME_PATTERN, fullmatch=True), st.sampled_from(
    [STUDY, STUDY.upper(), f" {STUDY}", f"{STUDY}\n", "-s", "--help", "", ".", "a" * 129, "a" * 128, "fz"]))
QUERIES = ["best", "pareto", "show", "plan", "studies", "confirm"]


@st.composite
def plan_texts(draw: Any) -> str:
    """Plan JSON: a valid plan edited, any JSON value, or any text."""
    kind = draw(st.sampled_from(["edited", "json", "text"]))
    if kind == "text":
        return draw(text)
    if kind == "json":
        return json.dumps(draw(junk))
    plan: dict[str, Any] = {"layers": [{"kind": "full"}, {"kind": "names", "names": ["a"]}], "layout": "flat"}
    path = draw(st.sampled_from(["layers", "layout", "layers.0", "layers.0.kind", "layers.1.names", "extra"]))
    value = draw(st.one_of(junk, st.sampled_from(["nested", "flat", "full", "names", "offload", [], ["a", "a"]])))
    *parents, key = path.split(".")
    where: Any = plan
    for p in parents:
        where = where[int(p)] if p.isdigit() else where[p]
    where[int(key) if key.isdigit() else key] = value
    return json.dumps(plan, allow_nan=True)


# --- judging --------------------------------------------------------------------------------
ONE_LINE_ERROR = re.compile(r"error: [^\n]+\n")
FIELD_FIRST = re.compile(r"error: (spec|storage|study|workload|plan|--[a-z]+)\b")


def outcome(result: Any, *, what: str) -> str:
    """``"error"`` (exit 2, one line naming the field) or ``"valid"`` (exit 0 or 1); any other
    ending raises AssertionError saying what came out."""
    said = f"{what}\nexit {result.exit_code}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"an exception escaped: {type(result.exception).__name__}: {result.exception}\n{said}")
    assert "Traceback" not in result.stdout + result.stderr, said
    if result.exit_code == 2:
        assert ONE_LINE_ERROR.fullmatch(result.stderr), f"not one line on stderr\n{said}"
        assert FIELD_FIRST.match(result.stderr), f"the line does not start with the field\n{said}"
        return "error"
    assert result.exit_code in (0, 1), said
    if result.exit_code == 1:
        assert ONE_LINE_ERROR.fullmatch(result.stderr), said
    return "valid"


def digest(db: Path) -> str:
    """The database's bytes with its write-ahead log's: a write shows at once, not at the checkpoint."""
    wal = db.with_name(db.name + "-wal")
    return hashlib.sha256(db.read_bytes() + (wal.read_bytes() if wal.exists() else b"")).hexdigest()


def make_real_study(folder: Path) -> Path:
    """A real searched study (3 plans of the cheap MLP) in ``folder/studies.db``, closed."""
    db = folder / "studies.db"
    spec = {**base_spec(f"sqlite:///{db}"), "study": STUDY, "trials": 3,
            "space": {"layout": "uniform", "choices": ["none", "full", "dots"]}}
    result = CliRunner().invoke(app, ["run", str(write_spec(folder / "spec.yaml", spec))])
    assert result.exit_code == 0, result.stdout + result.stderr
    gc.collect()  # close the search's connections: SQLite moves its WAL into the file now, not mid-test
    assert not list(folder.glob("studies.db-*")), "the search left its database open"
    return db


@pytest.fixture(scope="module")
def real_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_real_study(tmp_path_factory.mktemp("fuzz"))


class Fuzzer:
    """Runs fuzzed inputs through the CLI and judges them; counts what it saw (for the benchmark)."""

    def __init__(self, real_db: Path) -> None:
        self.real_db = real_db
        self.runner = CliRunner()
        self.counts: dict[str, dict[str, int]] = {}

    def _count(self, category: str, key: str) -> None:
        row = self.counts.setdefault(category, {"inputs": 0, "error": 0, "valid": 0, "traceback": 0, "db changed": 0})
        row[key] += 1

    @contextlib.contextmanager
    def _case(self, category: str) -> Iterator[Path]:
        """A fresh folder as working directory; the real database checked unchanged after."""
        before = digest(self.real_db)
        with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
            self._count(category, "inputs")
            try:
                yield Path(tmp)
            except AssertionError:
                self._count(category, "traceback")
                raise
            finally:
                if digest(self.real_db) != before:
                    self._count(category, "db changed")
                    raise AssertionError(f"{category}: the real study's database changed")

    def invoke(self, category: str, args: list[str], folder: Path, *, writes: bool = False) -> str:
        """Run ``remat-search ARGS``, judge it; bad input must leave no database in ``folder``."""
        result = self.runner.invoke(app, args, catch_exceptions=True)
        verdict = outcome(result, what=f"{category}: remat-search {args!r}")
        if verdict == "error" and not writes:
            written = [p.name for p in folder.rglob("*.db*")]
            assert not written, f"{category}: bad input wrote {written}: {args!r}"
        self._count(category, verdict)
        return verdict

    def url(self, template: str, folder: Path, *, writes: bool = False) -> str:
        """``template`` with its folder and real database; a command that ``writes`` gets a copy."""
        real = self.real_db
        if writes and "{real}" in template:
            real = folder / "copy.db"
            shutil.copyfile(self.real_db, real)
        return template.replace("{tmp}", str(folder)).replace("{real}", str(real))

    def spec(self, data: Any) -> str:
        with self._case("spec") as folder:
            if isinstance(data, dict):
                data = json.loads(json.dumps(data).replace("{tmp}", str(folder)))  # the storage of edited specs
            path = folder / "spec.yaml"
            path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=True))
            return self.invoke("spec", ["run", str(path)], folder)

    def budget(self, command: str, value: str) -> str:
        with self._case("budget") as folder:
            args = [command, "--study", STUDY, "--budget", value, "--storage", f"sqlite:///{self.real_db}"]
            if command == "confirm":  # re-times, so written: a study that does not exist
                args[2] = "no-such-study"
            return self.invoke("budget", args, folder)

    def storage(self, command: str, template: str) -> str:
        with self._case("storage URL") as folder:
            (folder / "notadb.txt").write_text("not a database\n")
            url = self.url(template, folder, writes=command == "run")
            if command == "run":
                spec = write_spec(folder / "spec.yaml", base_spec(f"sqlite:///{folder}/spec.db"))
                args = ["run", str(spec), "--storage", url]
            else:
                args = [command, "--storage", url] + ([] if command == "studies" else ["--study", STUDY])
                if command in ("best", "plan"):
                    args += ["--budget", "1GiB"]
                if command == "confirm":
                    args[-1] = "no-such-study"
            return self.invoke("storage URL", args, folder, writes=command == "run")

    def study(self, command: str, name: str) -> str:
        with self._case("study name") as folder:
            if command == "confirm" and name == STUDY:
                name = "no-such-study"  # confirming the real study would write to it
            args = [command, "--study", name, "--storage", f"sqlite:///{self.real_db}"]
            if command in ("best", "plan"):
                args += ["--budget", "1GiB"]
            return self.invoke("study name", args, folder)

    def plan_json(self, value: str) -> str:
        with self._case("plan JSON"):
            try:
                RematPlan.from_json(value)
            except SpecError as e:
                assert "\n" not in str(e) and str(e).startswith("plan: "), repr(str(e))
                self._count("plan JSON", "error")
                return "error"
            except Exception as e:
                raise AssertionError(f"plan JSON {value!r}: {type(e).__name__}: {e}") from e
            self._count("plan JSON", "valid")
            return "valid"


@pytest.fixture(scope="module")
def fuzzer(real_study: Path) -> Iterator[Fuzzer]:
    width = output.console.width
    output.console.width = 200
    yield Fuzzer(real_study)
    output.console.width = width


FUZZ = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(data=specs("sqlite:///{tmp}/studies.db"))
@example(data={**base_spec("sqlite:///{tmp}/studies.db"), "sampler": {"kind": "tpe", "seed": -1}})  # numpy refused
@example(data={**base_spec("sqlite:///{tmp}/studies.db"), "sampler": {"kind": "random", "seed": 2**32}})
@example(data={**base_spec("sqlite:///{tmp}/studies.db"), "budget": 0.5})  # read as 0 bytes: a division by zero
@example(data={**base_spec("sqlite:///{tmp}/studies.db"), "timing": {"timeout": 1e300}})  # overflowed poll()
@example(data={**base_spec("sqlite:///{tmp}/studies.db"), "a\nb": 1})  # an unknown key that broke the line
@example(data={**base_spec("sqlite:///{tmp}/studies.db"), "budget": 10**400})  # OverflowError from float()
def test_fuzzed_specs(fuzzer: Fuzzer, data: Any) -> None:
    fuzzer.spec(data)


@FUZZ
@given(command=st.sampled_from(["best", "plan", "confirm"]), value=budgets)
@example(command="best", value=f"1{'0' * 400}")  # OverflowError from float()
@example(command="best", value=f"1{'0' * 400}TiB")  # OverflowError from pydantic's ByteSize
def test_fuzzed_budgets(fuzzer: Fuzzer, command: str, value: str) -> None:
    fuzzer.budget(command, value)


@FUZZ
@given(command=st.sampled_from([*QUERIES, "run"]), template=storage_urls)
@example(command="studies", template="postgresql://u@localhost:notaport/db")  # ValueError from SQLAlchemy
@example(command="studies", template="postgresql://\x93")  # UnicodeError looking the host up
@example(command="run", template="sqlite:///{tmp}/}.db")  # optuna formats the URL as a template
def test_fuzzed_storage_urls(fuzzer: Fuzzer, command: str, template: str) -> None:
    fuzzer.storage(command, template)


@FUZZ
@given(command=st.sampled_from([q for q in QUERIES if q != "studies"]), name=study_names)
def test_fuzzed_study_names(fuzzer: Fuzzer, command: str, name: str) -> None:
    fuzzer.study(command, name)


@settings(FUZZ, max_examples=200)
@given(value=plan_texts())
@example(value='{"layers": [{"kind": "full", "a\\nb": 1}]}')  # an unknown key that broke the line
def test_fuzzed_plan_json(fuzzer: Fuzzer, value: str) -> None:
    fuzzer.plan_json(value)

