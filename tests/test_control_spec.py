"""The job spec: errors name the field path (in Python, in the CLI's YAML loader, and as HTTP 422)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.control.jobfile import load_spec_file
from tidal.control.spec import parse_spec, spec_errors

GOOD = {"name": "gpt", "gpus": 2, "command": ["python", "train.py"]}


def errors(**changes) -> list[str]:
    spec = {**GOOD, **changes}
    spec = {k: v for k, v in spec.items() if v is not ...}
    with pytest.raises(ValidationError) as e:
        parse_spec(spec)
    return spec_errors(e.value)


def test_defaults_and_gpu_forms():
    s = parse_spec(GOOD)
    assert (s.kind, s.priority, s.max_restarts, s.grace_s) == ("spot", 0, 3, 30.0)
    assert s.gpus.model_dump() == {"min": 2, "max": 2, "multiple_of": 1}
    assert s.checkpoint.url is None and s.checkpoint.tiers is None and s.checkpoint.interval_s == "auto"
    e = parse_spec({**GOOD, "gpus": {"min": 2, "max": 8, "multiple_of": 2}, "kind": "dedicated"})
    assert e.gpus.max == 8 and e.kind == "dedicated"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"gpus": 0}, "gpus.min: Input should be greater than or equal to 1"),
        ({"gpus": {"min": 2, "max": 1}}, "gpus: max (1) must be >= min (2)"),
        (
            {"gpus": {"min": 2, "max": 5, "multiple_of": 2}},
            "gpus: max (5) must be a multiple of multiple_of (2)",
        ),
        ({"gpus": {"min": 1, "maximum": 4}}, "gpus.maximum: Extra inputs are not permitted"),
        ({"gpus": "four"}, "gpus: expected a GPU count (e.g. 4) or {min, max, multiple_of}, got str"),
        ({"gpus": ...}, "gpus: Field required"),
        ({"command": "python train.py"}, "command: expected a list of arguments"),
        ({"command": []}, "command: List should have at least 1 item"),
        ({"command": ["python", 3]}, "command[1]: Input should be a valid string"),
        (
            {"command": ...},
            "command: Field required: an argument list, e.g. [python, train.py] (or run: a shell",
        ),
        ({"run": "python train.py"}, "command: give command (an argument list) or run (a shell script), not"),
        ({"command": ..., "run": ""}, "run: String should have at least 1 character"),
        ({"kind": "cheap"}, "kind: Input should be 'spot' or 'dedicated'"),
        ({"name": "no spaces"}, "name: expected 1-63 letters"),
        ({"env": {"RANK": "3"}}, "env.RANK: RANK is set by the platform"),
        (
            {"env": {"TIDAL_CKPT_TIERS": "/other/tenant"}},
            "env.TIDAL_CKPT_TIERS: TIDAL_CKPT_TIERS is set by the platform",
        ),
        ({"env": {"X": 1}}, "env.X: Input should be a valid string"),
        (
            {"checkpoint": {"interval_s": 0}},
            "checkpoint.interval_s: expected a number of seconds > 0 or 'auto'",
        ),
        (
            {"checkpoint": {"interval_s": "often"}},
            "checkpoint.interval_s: expected a number of seconds > 0 or 'auto'",
        ),
        (
            {"checkpoint": {"tiers": ["shm", "/ck", "s3://x/p"]}},
            "checkpoint.tiers: tier 's3://x/p': 'x' is not a valid",
        ),
        ({"checkpoint": {"tiers": ["shmm", "/ck"]}}, "checkpoint.tiers: tiers[0] 'shmm': not a tier"),
        ({"checkpoint": {"url": "/ck", "tiers": ["shm", "/ck"]}}, "checkpoint: give the location once"),
        ({"checkpoint": {"path": "/x"}}, "checkpoint.path: Extra inputs are not permitted"),
        ({"max_restarts": -1}, "max_restarts: Input should be greater than or equal to 0"),
        ({"workdir": "rel/dir"}, "workdir: expected an absolute path"),
        ({"gpu": 2}, "gpu: Extra inputs are not permitted"),
    ],
)
def test_errors_name_the_field(change, expected):
    errs = errors(**change)
    assert any(e.startswith(expected) for e in errs), errs


def test_yaml_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "job.yaml"
    f.write_text("name: a\ngpus: 1\ncommand: [python, t.py]\ncheckpoint: {url: ck}\n")
    doc = load_spec_file(f)
    assert doc["workdir"] == str(tmp_path / "sub") and doc["checkpoint"]["url"] == str(
        tmp_path / "sub" / "ck"
    )
    f.write_text("name: a\nworkdir: ..\ngpus: 1\ncommand: [python]\ncheckpoint: {url: 's3://b/x'}\n")
    doc = load_spec_file(f)
    assert doc["workdir"] == str(tmp_path) and doc["checkpoint"]["url"] == "s3://b/x"
    f.write_text("name: a\ngpus: 1\ncommand: [python]\n"
                 "checkpoint: {tiers: [shm, ./ck, {url: ../up, every: 2}, 's3://bkt/x'], interval_s: auto}\n")
    doc = load_spec_file(f)
    assert doc["checkpoint"]["tiers"] == [
        "shm",
        str(tmp_path / "sub" / "ck"),
        {"url": str(tmp_path / "up"), "every": 2},
        "s3://bkt/x",
    ]
    f.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="job.yaml: not valid YAML"):
        load_spec_file(f)
    f.write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_spec_file(f)


def test_run_is_a_shell_script_run_by_bash():
    from tidal.control.spec import JobSpec

    spec = JobSpec.model_validate({"name": "a", "gpus": 1, "run": "pip install -e . && python train.py"})
    assert spec.command == ["bash", "-c", "pip install -e . && python train.py"]
    assert spec.model_dump()["run"] == "pip install -e . && python train.py"


@pytest.mark.parametrize(("opts", "want"), [
    ({"gpus": "4"}, {"gpus": 4}),
    ({"gpus": "2-8"}, {"gpus": {"min": 2, "max": 8}}),
    ({"name": "x", "kind": "dedicated", "priority": 3}, {"name": "x", "kind": "dedicated", "priority": 3}),
    ({"env": ["A=1", "B=x=y", "C="]}, {"env": {"KEEP": "k", "A": "1", "B": "x=y", "C": ""}}),
])
def test_submit_overrides(opts, want):
    from tidal.control.jobfile import apply_overrides

    doc = {"name": "gpt", "gpus": 2, "command": ["python"], "env": {"KEEP": "k", "A": "0"}}
    assert apply_overrides(doc, **opts) == {**doc, **want}
    assert doc["env"] == {"KEEP": "k", "A": "0"}  # the file's dict is not changed


def test_submit_overrides_keep_multiple_of_and_name_bad_options():
    from tidal.control.jobfile import apply_overrides

    assert apply_overrides({"gpus": {"min": 2, "multiple_of": 2}}, gpus="4-8")["gpus"] == {
        "min": 4, "max": 8, "multiple_of": 2}
    for bad, msg in (({"gpus": "four"}, "--gpus: expected N or MIN-MAX"), ({"gpus": "2-"}, "--gpus"),
                     ({"env": ["NOEQUALS"]}, "--env: expected K=V, got 'NOEQUALS'"),
                     ({"env": ["=v"]}, "--env")):
        with pytest.raises(ValueError, match=msg):
            apply_overrides({}, **bad)
