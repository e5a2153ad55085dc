"""The engine adapters read the engines' own /metrics: recorded texts with the documented names of
llama.cpp (recorded from llama-server), vLLM and SGLang; and the replicas a TTFT target needs."""

from __future__ import annotations

import math
import re

import pytest

from tidal.policy.queueing import servers_needed
from tidal.serving.engines import (
    ENGINES,
    LLAMA_CPP,
    SGLANG,
    VLLM,
    EngineStats,
    histogram_quantile,
    parse_metrics,
    replicas_needed,
    ttft_delta,
)

LLAMA_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 800
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 1.5
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3200
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 6.5
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 2400
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 402.512
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.4
"""

VLLM_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Llama-3.1-8B"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Llama-3.1-8B"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Llama-3.1-8B"} 51200.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Llama-3.1-8B"} 150.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Llama-3.1-8B"} 50.0
# TYPE vllm:request_inference_time_seconds histogram
vllm:request_inference_time_seconds_sum{engine="0",model_name="Llama-3.1-8B"} 240.0
vllm:request_inference_time_seconds_bucket{engine="0",le="+Inf",model_name="Llama-3.1-8B"} 200.0
vllm:request_inference_time_seconds_count{engine="0",model_name="Llama-3.1-8B"} 200.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Llama-3.1-8B"} 21.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="Llama-3.1-8B"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Llama-3.1-8B"} 120.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="Llama-3.1-8B"} 190.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="Llama-3.1-8B"} 198.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Llama-3.1-8B"} 200.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Llama-3.1-8B"} 200.0
"""

SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen2.5-7B",tp_rank="0"} 12.0
sglang:num_running_reqs{model_name="Qwen2.5-7B",tp_rank="1"} 0.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen2.5-7B",tp_rank="0"} 4.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="Qwen2.5-7B",tp_rank="0"} 7557572.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="Qwen2.5-7B"} 30000.0
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{model_name="Qwen2.5-7B"} 90000.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="Qwen2.5-7B"} 30000.0
sglang:e2e_request_latency_seconds_count{model_name="Qwen2.5-7B"} 30000.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="Qwen2.5-7B"} 2351.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen2.5-7B"} 10000.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="Qwen2.5-7B"} 29000.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen2.5-7B"} 30000.0
sglang:time_to_first_token_seconds_count{model_name="Qwen2.5-7B"} 30000.0
"""


def test_each_engine_reads_its_own_names():
    ll = parse_metrics(LLAMA_CPP, LLAMA_TEXT)
    assert (ll.running, ll.waiting, ll.generated_tokens, ll.busy_s, ll.requests) == (2, 3, 3200, 8.0, None)
    assert ll.ttft_buckets == ()
    v = parse_metrics(VLLM, VLLM_TEXT)
    assert (v.running, v.waiting, v.generated_tokens, v.busy_s, v.requests) == (7, 1, 51200, 240, 200)
    assert histogram_quantile(0.5, v.ttft_buckets) == pytest.approx(0.04 + 0.06 * 80 / 100)
    assert histogram_quantile(0.995, v.ttft_buckets) == 0.5  # in +Inf: the last finite bound
    s = parse_metrics(SGLANG, SGLANG_TEXT)
    assert (s.running, s.waiting, s.requests, s.busy_s) == (12, 4, 30000, 90000)  # summed over tp ranks
    assert histogram_quantile(0.99, s.ttft_buckets) == pytest.approx(1.0)
    assert set(ENGINES) == {"llama.cpp", "vllm", "sglang"} and all(e.health_path == "/health"
                                                                   for e in ENGINES.values())


@pytest.mark.parametrize("engine,text", [(LLAMA_CPP, VLLM_TEXT), (VLLM, LLAMA_TEXT), (SGLANG, VLLM_TEXT)])
def test_another_engines_text_is_refused_naming_what_is_missing(engine, text):
    with pytest.raises(ValueError, match=f"{engine.name} /metrics lacks {engine.running}"):
        parse_metrics(engine, text)


def test_not_prometheus_text_is_refused():
    with pytest.raises(ValueError, match="llama.cpp /metrics"):
        parse_metrics(LLAMA_CPP, "llamacpp:requests_processing one two three\n")


def test_ttft_between_two_scrapes():
    a = ((0.1, 10.0), (1.0, 20.0), (math.inf, 20.0))
    b = ((0.1, 10.0), (1.0, 40.0), (math.inf, 40.0))
    d = ttft_delta(a, b)
    assert d == ((0.1, 0.0), (1.0, 20.0), (math.inf, 20.0))
    assert histogram_quantile(0.5, d) == pytest.approx(0.1 + 0.9 * 0.5)
    assert histogram_quantile(0.5, ttft_delta(a, a)) is None


def _st(requests, busy_s, waiting=0.0, tokens=0.0):
    return EngineStats(0.0, waiting, tokens, busy_s, requests)


def test_replicas_from_the_rate_and_the_measured_service_time():
    # 2 replicas, 200 requests in 10 s, 20 busy seconds: 20 requests/s of 0.1 s each
    before = [_st(100, 10.0), _st(100, 10.0)]
    after = [_st(200, 20.0, tokens=1000), _st(200, 20.0, tokens=1000)]
    d = replicas_needed(before, after, 10.0, slo_s=0.05, slots=2)
    servers = servers_needed(20.0, 10.0, 0.05, 0.99, "queue")
    assert d.rate_per_s == 20.0 and d.service_s == pytest.approx(0.1) and d.tokens_per_s == 200.0
    assert d.replicas == math.ceil(servers / 2) and d.replicas >= 2
    looser = replicas_needed(before, after, 10.0, slo_s=5.0, slots=2)
    assert looser.replicas <= d.replicas


def test_llama_cpp_counts_requests_at_the_router_and_a_restart_counts_from_zero():
    before = [_st(None, 100.0), _st(None, 50.0)]
    after = [_st(None, 104.0), _st(None, 4.0)]  # the second restarted: its 4 s are all new
    d = replicas_needed(before, after, 8.0, slo_s=1.0, slots=2, router_requests=80)
    assert d.rate_per_s == 10.0 and d.service_s == pytest.approx(8.0 / 80)
    with pytest.raises(ValueError, match="router_requests"):
        replicas_needed(before, after, 8.0, slo_s=1.0, slots=2)


def test_idle_is_the_minimum_and_a_queue_without_finished_requests_is_unknown():
    idle = replicas_needed([_st(None, 1.0)], [_st(None, 1.0)], 5.0, slo_s=1.0, slots=2, router_requests=0)
    assert idle.replicas == 1 and idle.service_s is None
    stuck = replicas_needed([_st(None, 1.0)], [_st(None, 1.0, waiting=4)], 5.0, slo_s=1.0, slots=2,
                            router_requests=0)
    assert math.isnan(stuck.replicas)


@pytest.mark.parametrize("args,says", [(["--replicas", "1"], "--replicas 1: expected 2 to 16"),
                                       (["--rate", "0"], "--rate must be in (0, 200]"),
                                       (["--max-tokens", "0"], "--max-tokens must be 1 to 1024"),
                                       (["--pairs", "0"], "--pairs 0: expected 1 to 50")])
def test_engine_bench_refuses_bad_options_naming_them(args, says):
    from typer.testing import CliRunner

    from tidal.serving.cli import app

    r = CliRunner().invoke(app, ["engine-bench", *args])
    assert r.exit_code == 2 and says in " ".join(r.output.split())


ENGINE_BLOCK = {"adapter": "llama.cpp", "nodes": "2x1", "engine": {"model": "m.gguf"},
                "latency_target_s": 0.5}


@pytest.mark.parametrize(("change", "says"), [
    ({"engine": None}, "serving.engine.model is required"),
    ({"engine": {"model": "m.gguf", "slot": 2}}, "serving.engine: unknown field 'slot'"),
    ({"engine": {"model": "m.gguf", "slots": 0}}, "serving.engine.slots must be a whole number in [1, 256]"),
    ({"latency_target_s": None}, "serving.nodes and serving.latency_target_s are required"),
    ({"min_replicas": 3}, "serving.min_replicas must be a number of replicas in (0, 2]"),
    ({"prometheus": "http://p:9090"}, "serving.prometheus does not apply to adapter llama.cpp"),
    ({"history_days": 1}, "serving.trace and serving.history_days go together"),
])
def test_the_engine_adapters_settings_are_checked_naming_the_field(change, says):
    from tidal.serving.watch import WatchConfig

    with pytest.raises(ValueError, match="^" + re.escape(says)):
        WatchConfig.from_dict({k: v for k, v in {**ENGINE_BLOCK, **change}.items() if v is not None})
    with pytest.raises(ValueError, match="serving.engine applies only to adapter: llama.cpp"):
        WatchConfig.from_dict({"serving_gpus": 2, "trace": "t.csv", "engine": {"model": "m.gguf"}})
    cfg = WatchConfig.from_dict(ENGINE_BLOCK)
    assert cfg.pool_gpus == 2 and cfg.requests() is None and "llama.cpp replicas of m.gguf" in cfg.describe()


def test_pairs_pool_each_phase_over_the_runs_each_cut_at_its_own_bounds():
    from tidal.serving.engine_bench import pooled
    from tidal.serving.loadgen import Record

    def recs(ttft: float) -> list[Record]:  # one request a second for 10 s
        return [Record(t_s=float(t), latency_s=ttft, status=200, ttft_s=ttft, tokens=4) for t in range(10)]
    one = pooled([(recs(0.01), (2.0, 6.0, 7.0))], 10.0)
    assert [one[p]["requests"] for p in ("before", "lent", "reclaiming", "after")] == [2, 4, 1, 3]
    two = pooled([(recs(0.01), (2.0, 6.0, 7.0)), (recs(0.03), (3.0, 5.0, 8.0))], 10.0)
    assert [two[p]["requests"] for p in ("before", "lent", "reclaiming", "after")] == [5, 6, 4, 5]
    assert two["before"]["seconds"] == 5.0 and two["lent"]["tokens_per_s"] == 4.0
    assert two["before"]["ttft_p50_s"] == 0.03 and two["lent"]["ttft_p50_s"] == 0.01  # 2 + 3, 4 + 2 requests


def test_the_ratio_is_the_worst_lending_phase_and_the_others_show_the_noise():
    from tidal.serving.engine_bench import compare

    def phase(p99, n=20):
        return {"ttft_p99_s": p99, "requests": n, "failed": 0}
    with_ = {"before": phase(0.3), "lent": phase(0.2), "reclaiming": phase(0.5, 3), "after": phase(0.1)}
    without = {"before": phase(0.1), "lent": phase(0.1), "reclaiming": phase(0.1, 3), "after": phase(0.1)}
    out = compare(with_, without, ("lent", "reclaiming"))
    assert out["ttft_p99_ratio"] == 2.0  # reclaiming holds too few requests; before is not lending's
    assert out["ttft_p99_ratio_by_phase"] == {"before": 3.0, "lent": 2.0, "after": 1.0}
