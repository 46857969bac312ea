"""Hostile configuration: store URLs, policy files, alert receiver files and TrainingJob specs.
Whatever they hold, the reader gives its own named error (StoreConfigError naming the URL with
its password masked; PolicyConfigError / AlertConfigError naming the file and the field;
SpecError naming the field) or a result, never another exception, and never takes long.

Inputs that once broke a reader stay as explicit examples: `clickhouse://u:pw@[::1` and
NFKC-folding hosts (urlsplit's ValueError escaped, unmasked), a chdb path with a NUL, a URL
without `//` whose password was shown; an integer of more than 4300 digits, a date such as
2024-13-01 and a document nested past the recursion limit (plain ValueError, RecursionError);
an integer too large for a float where a number is expected (OverflowError); receiver keys of
mixed types (TypeError while sorting them); and YAML aliases that make a few lines stand for
billions of elements (minutes of CPU and gigabytes spelling them out in a message)."""

from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tracehound.controller.alerts import AlertConfigError, load_receivers
from tracehound.controller.operator.trainingjob import SpecError, read_spec
from tracehound.controller.orchestrators.jobspec import TrainingJobSpec
from tracehound.controller.policy.file import (
    EXAMPLE,
    KINDS,
    PolicyConfigError,
    load_policy,
    policy_document,
    policy_from_document,
)
from tracehound.controller.policy.recovery import PolicySettings
from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.store import open_store
from tracehound.tracing.store.urls import embedded_path, mask_url, parse_server_url

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
yaml_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) \
    | st.dates() | st.binary(max_size=8)
yaml_values = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        yaml_scalars.filter(lambda v: not isinstance(v, float) or v == v), inner, max_size=4),
    max_leaves=12,
)
HUGE_INT = "9" * 5000
DEEP = "[" * 5000
LAUGHS = "[" + ", ".join(
    ["&a0 [x, x, x, x, x, x, x, x, x]"]
    + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]) + "]"
"""A YAML list of a few hundred characters that stands for 9**10 (3.5 billion) strings."""


# -- store URLs -----------------------------------------------------------------------------

SECRET = "Zq7Secret"
url_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
password_chars = st.text(
    alphabet=string.ascii_letters + string.digits + "!$&'()*+,;=-._~%:@[]\\\"{} \t\x00é✓",
    max_size=12)


@FUZZ
@given(url=url_text)
@example(url="clickhouse://u:pw@[::1/db")
@example(url="clickhouse://u:pw@ho\uff03st/db")
@example(url="chdb:///tmp/a\x00b")
@example(url="clickhouse://h/d\u00e9")
def test_an_arbitrary_store_url_is_opened_or_refused_with_store_config_error(url: str) -> None:
    if url.startswith("chdb://"):
        # an embedded store would really be created: only the path is read here
        try:
            path = embedded_path(url)
        except StoreConfigError as exc:
            assert repr(url) in str(exc)
        else:
            assert "\x00" not in path
        return
    try:
        store = open_store(url, create=False)
    except StoreConfigError as exc:
        assert str(exc).startswith(f"store URL {mask_url(url)!r}"), str(exc)
        return
    store.close()


@FUZZ
@given(scheme=st.sampled_from(["clickhouse", "chdb", "http", "", "clickhouse+tls", "cLiCkHoUsE"]),
       slashes=st.sampled_from(["://", ":/", ":", ":///"]),
       user=st.text(alphabet=string.ascii_letters + "é", max_size=6),
       password=password_chars, host=url_text, rest=url_text)
@example(scheme="clickhouse", slashes=":", user="u", password="", host="host", rest="")
@example(scheme="clickhouse", slashes="://", user="u", password="", host="[::1", rest="/db")
@example(scheme="clickhouse", slashes="://", user="u", password="", host="h\uff03", rest="/d")
def test_a_password_never_shows_in_a_store_url_error(
    scheme: str, slashes: str, user: str, password: str, host: str, rest: str,
) -> None:
    secret = SECRET + password
    url = f"{scheme}{slashes}{user}:{secret}@{host.replace('/', '')}{rest}"
    if url.startswith("chdb://"):
        return  # a directory path has no password
    try:
        store = open_store(url, create=False)
    except StoreConfigError as exc:
        assert SECRET not in str(exc), str(exc)
        return
    assert SECRET not in store.url
    store.close()


@FUZZ
@given(url=url_text)
@example(url="clickhouse://u:pw@[::1/db")
def test_masking_any_string_never_raises(url: str) -> None:
    shown = mask_url(url)
    try:
        address = parse_server_url(url)
    except StoreConfigError as exc:
        assert repr(shown) in str(exc)
        return
    if address.password:
        assert shown.count(":***@") == 1


# -- policy files ---------------------------------------------------------------------------


def write(directory: Path, name: str, data: bytes | str) -> Path:
    path = directory / name
    path.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return path


def expect_policy(path: Path) -> PolicySettings | None:
    """The settings, or None after checking the error names the file."""
    try:
        return load_policy(path)
    except PolicyConfigError as exc:
        assert str(exc).startswith(f"{path}: "), str(exc)
        return None


_files = itertools.count()


@FUZZ
@given(text=st.text(max_size=300) | st.binary(max_size=300))
@example(text=f"version: 1\nmax_restarts: {HUGE_INT}\n")
@example(text=f"version: 1\nrules: {DEEP}\n")
@example(text="version: 1\nmax_restarts: 2024-13-01\n")
@example(text="version: 1\nrules:\n  hang: {act_from: " + "9" * 400 + "}\n")
@example(text=b"version: 1\nuncertain: \xff\xfe\n")
@example(text="version: 1\nwatch_s: !!python/object/apply:os.system ['touch /tmp/pwned']\n")
def test_an_arbitrary_policy_file_loads_or_names_itself(tmp_path: Path, text: str | bytes) -> None:
    expect_policy(write(tmp_path, f"policy-{next(_files)}.yaml", text))


def test_aliases_standing_for_billions_of_elements_are_refused_at_once(tmp_path: Path) -> None:
    """A billion laughs: refused by name, and quickly (no wall-time limit here: a walk of every
    path, or a repr of every element, would take hours and gigabytes, not a hang guard)."""
    policy = write(tmp_path, "laughs.yaml", f"version: 1\nlaughs: {LAUGHS}\n")
    with pytest.raises(PolicyConfigError, match="laughs: unknown key"):
        load_policy(policy)
    value = write(tmp_path, "value.yaml", f"version: 1\nrules: {{hang: {{why: {LAUGHS}}}}}\n")
    with pytest.raises(PolicyConfigError, match=r"rules\.hang\.why: expected a string") as caught:
        load_policy(value)
    assert len(str(caught.value)) < 20_000
    receivers = write(tmp_path, "receivers.yaml", "receivers:\n- name: a\n  kind: slack\n"
                      f"  url: http://127.0.0.1:9/\n  jobs: {LAUGHS}\n")
    with pytest.raises(AlertConfigError, match=r"receivers\[0\]\.jobs") as alert:
        load_receivers(receivers)
    assert len(str(alert.value)) < 20_000


FIELDS = ["max_restarts", "max_restarts_per_hour", "max_isolations", "max_isolations_per_hour",
          "restart_backoff_s", "restart_backoff_max_s", "watch_s", "uncertain"]
RULE_FIELDS = ["response", "act_from", "isolate_from", "repeats", "why"]


@FUZZ
@given(field=st.sampled_from(FIELDS), value=yaml_values)
@example(field="watch_s", value=10**400)
@example(field="max_restarts", value=[1, 2])
def test_a_bad_value_is_named_by_its_key(field: str, value: Any) -> None:
    doc = {"version": 1, field: value}
    try:
        policy_from_document(doc, source="policy.yaml")
    except PolicyConfigError as exc:
        assert str(exc).startswith(f"policy.yaml: {field}: expected "), str(exc)


@FUZZ
@given(kind=st.sampled_from(KINDS),
       field=st.sampled_from(RULE_FIELDS), value=yaml_values)
@example(kind="hang", field="act_from", value=10**400)
def test_a_bad_rule_value_is_named_by_its_path(kind: str, field: str, value: Any) -> None:
    doc = {"version": 1, "rules": {kind: {field: value}}}
    try:
        policy_from_document(doc, source="policy.yaml")
    except PolicyConfigError as exc:
        assert str(exc).startswith(f"policy.yaml: rules.{kind}.{field}: expected "), str(exc)


@FUZZ
@given(doc=yaml_values)
def test_an_arbitrary_document_is_a_policy_or_a_named_error(tmp_path: Path, doc: Any) -> None:
    path = write(tmp_path, f"doc-{next(_files)}.yaml", yaml.safe_dump(doc))
    expect_policy(path)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_valid_policy_round_trips(data: st.DataObject) -> None:
    base = policy_document(PolicySettings())
    doc = yaml.safe_load(EXAMPLE)
    doc["watch_s"] = data.draw(st.floats(min_value=0, max_value=1e300))
    doc["max_restarts"] = data.draw(st.integers(min_value=0, max_value=10**30))
    settings_ = policy_from_document(doc, source="p")
    assert policy_from_document(policy_document(settings_), source="p") == settings_
    assert set(base) == set(policy_document(settings_))


# -- alert receiver files -------------------------------------------------------------------

RECEIVER = {"name": "ops", "kind": "webhook", "url": "https://127.0.0.1:9/hook",
            "secret": "s3cr3t", "timeout_s": 2, "jobs": ["exp-*"]}


def expect_receivers(path: Path) -> None:
    try:
        load_receivers(path)
    except AlertConfigError as exc:
        assert str(exc).startswith(f"{path}: "), str(exc)


@FUZZ
@given(text=st.text(max_size=300) | st.binary(max_size=300))
@example(text=f"receivers: {HUGE_INT}")
@example(text=DEEP)
@example(text="receivers:\n- {1: 2, a: b}\n")
@example(text="receivers:\n- {null: 2, 2024-01-01: b, 1.5: c}\n")
@example(text="receivers:\n- {name: a, kind: slack, url: 'http://x', timeout_s: " + "9" * 400
         + "}\n")
@example(text="receivers: [{name: a, kind: slack, url: 'http://[x'}]")
@example(text="receivers: [{name: a, kind: slack, url: 'ftp://[x'}]")
def test_an_arbitrary_receivers_file_loads_or_names_itself(tmp_path: Path,
                                                           text: str | bytes) -> None:
    expect_receivers(write(tmp_path, f"receivers-{next(_files)}.yaml", text))


@FUZZ
@given(field=st.sampled_from([*sorted(RECEIVER), "routing_key", "ca_file", "unknown"]),
       value=yaml_values)
def test_a_bad_receiver_field_is_named(tmp_path: Path, field: str, value: Any) -> None:
    entry = {**RECEIVER, field: value}
    path = write(tmp_path, f"r-{next(_files)}.yaml", yaml.safe_dump({"receivers": [entry]}))
    try:
        load_receivers(path)
    except AlertConfigError as exc:
        assert str(exc).startswith(f"{path}: receivers[0]"), str(exc)
        assert field in str(exc) or "url" in str(exc), str(exc)


@FUZZ
@given(doc=yaml_values)
def test_an_arbitrary_document_is_receivers_or_a_named_error(tmp_path: Path, doc: Any) -> None:
    expect_receivers(write(tmp_path, f"doc-{next(_files)}.yaml", yaml.safe_dump(doc)))


# -- TrainingJob specs ----------------------------------------------------------------------

SPEC = {"image": "trainer:1", "command": ["python", "train.py"], "nodes": 2, "spareNodes": 1}
SPEC_FIELDS = ["image", "command", "nodes", "procsPerNode", "spareNodes", "warmStandby",
               "nodeSelector", "checkpointDir", "env", "resources", "volumes", "volumeMounts",
               "masterPort", "policy"]


@FUZZ
@given(spec=json_values | st.dictionaries(st.sampled_from(SPEC_FIELDS) | st.text(max_size=8),
                                          json_values, max_size=6))
@example(spec={("a",): 1})
@example(spec={**SPEC, "policy": {"version": 1, "watch_s": 10**400}})
def test_an_arbitrary_spec_is_read_or_a_spec_error(spec: Any) -> None:
    try:
        read = read_spec(spec, source="trainingjob default/exp7")
    except SpecError as exc:
        assert str(exc).startswith("trainingjob default/exp7: spec"), str(exc)
        return
    assert isinstance(read, TrainingJobSpec)


@FUZZ
@given(field=st.sampled_from(SPEC_FIELDS), value=json_values)
@example(field="policy", value={"version": 1, "watch_s": 10**400})
@example(field="command", value=[])
@example(field="nodes", value=True)
def test_a_bad_spec_field_is_named(field: str, value: Any) -> None:
    try:
        read_spec({**SPEC, field: value}, source="tj")
    except SpecError as exc:
        assert str(exc).startswith(f"tj: spec.{field}"), str(exc)
