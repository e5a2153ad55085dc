"""Job traces for the simulator: the native CSV, the real ElasticFlow/Philly file, the spot backlog."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tidal.sim.jobs import BacklogSource, SpotBacklog, load_jobs, load_native, load_philly

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
PHILLY = TRACES / "elasticflow-philly-jobs.csv"


def test_native_csv(tmp_path):
    p = tmp_path / "jobs.csv"
    p.write_text("submit_s,tenant,kind,priority,min_gpus,max_gpus,work_gpu_s,gpus_per_node\n"
                 "600,nlp,spot,0,4,32,1440000,\n"
                 "0,vision,dedicated,1,8,8,2880000,8\n")
    jobs = load_jobs(p)
    assert [j.tenant for j in jobs] == ["vision", "nlp"]  # in submission order
    v, n = jobs
    assert (v.kind, v.priority, v.min_gpus, v.max_gpus, v.gpus_per_node, v.work_gpu_s) == (
        "dedicated",
        1,
        8,
        8,
        8,
        2.88e6,
    )
    assert (n.min_gpus, n.max_gpus, n.gpus_per_node, n.submit_s) == (4, 32, None, 600.0)


@pytest.mark.parametrize("row, message", [
    ("0,a,batch,0,1,1,10", "column 'kind' must be one of"),
    ("0,a,spot,0,x,1,10", "column 'min_gpus' must be an integer"),
    ("0,a,spot,0,4,2,10", "max_gpus (2) < min_gpus (4)"),
    ("0,a,spot,0,1,1,-5", "column 'work_gpu_s' must be >= 0"),
])
def test_native_csv_errors_name_the_line_and_column(tmp_path, row, message):
    p = tmp_path / "bad.csv"
    p.write_text("submit_s,tenant,kind,priority,min_gpus,max_gpus,work_gpu_s\n" + row + "\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: ") as e:
        load_native(p)
    assert message in str(e.value)


def test_native_csv_missing_column(tmp_path):
    p = tmp_path / "j.csv"
    p.write_text("submit_s,tenant\n0,a\n")
    with pytest.raises(ValueError, match="missing column"):
        load_native(p)


@pytest.mark.skipif(not PHILLY.exists(), reason="../shared/traces is absent")
def test_philly_loader_parses_the_real_file():
    jobs = load_jobs(PHILLY)
    assert len(jobs) == 876
    assert {j.min_gpus for j in jobs} == {1, 2, 4} and all(j.min_gpus == j.max_gpus for j in jobs)
    assert {j.tenant for j in jobs} == {"resnet50", "vgg16", "gpt2", "bert", "deepspeech2", "inception3"}
    assert sum(j.work_gpu_s for j in jobs) / 3600 == pytest.approx(42816.08, rel=1e-4)
    assert jobs[0].submit_s == 0 and max(j.submit_s for j in jobs) / 86400 == pytest.approx(91.56, abs=0.01)
    assert all(j.kind == "spot" for j in load_philly(PHILLY, kind="spot"))


def test_backlog_is_seeded_heavy_tailed_and_valid():
    def draw(seed):
        src = BacklogSource(SpotBacklog(), 8, np.random.default_rng(seed))
        return [src.draw(0.0) for _ in range(2000)]

    a, b = draw(1), draw(1)
    assert a == b and a != draw(2)
    hours = np.array([j.work_gpu_s / 3600 / j.min_gpus for j in a])
    assert hours.min() >= 1.0 and np.median(hours) < 3 and hours.max() > 50  # heavy tail
    for j in a:
        step = j.gpus_per_node or 1
        assert j.min_gpus % step == 0 and j.max_gpus % step == 0 and j.max_gpus >= j.min_gpus
        assert j.gpus_per_node is None or j.min_gpus >= 8
    assert {j.min_gpus for j in a} == set(SpotBacklog().sizes)



@pytest.mark.parametrize("kw, field", [
    ({"size_weights": (0,) * 7}, "size_weights"),  # was an IndexError at the first draw
    ({"size_weights": (-1, 1, 1, 1, 1, 1, 1)}, "size_weights"),  # was drawn silently
    ({"elastic_weights": (math.nan, 1, 1)}, "elastic_weights"),
    ({"elastic_weights": (math.inf, 1, 1)}, "elastic_weights"),
])
def test_backlog_weights_that_are_no_distribution_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SpotBacklog.{field}"):
        SpotBacklog(**kw)


def test_backlog_sizes_left_by_a_gpu_cap_need_weight():
    b = SpotBacklog(sizes=(1, 64), size_weights=(0.0, 1.0))
    with pytest.raises(ValueError, match="at most 8 GPUs has weight 0"):
        BacklogSource(b, 8, np.random.default_rng(0), max_gpus=8)
