"""``GET /metrics``: the scheduler's counters in Prometheus' text format, through ``prometheus_client``.

The names follow llama-server's ``/metrics`` (``llamacpp:*`` there, ``powerinfer_*`` here, with
Prometheus' ``_total`` suffix on counters):

* ``powerinfer_requests_total{outcome="served|cancelled|failed"}``: requests ended so far;
* ``powerinfer_prompt_tokens_total``, ``powerinfer_prompt_seconds_total``: prompt tokens evaluated
  and the seconds that took; ``powerinfer_prompt_tokens_seconds``: their ratio (tokens/s);
* ``powerinfer_tokens_predicted_total``, ``powerinfer_decode_seconds_total``: tokens generated (all
  slots) and the seconds of decode steps; ``powerinfer_predicted_tokens_seconds``: the aggregate
  decode speed (tokens/s over every slot);
* ``powerinfer_decode_steps_total``, ``powerinfer_busy_slots_per_decode``: batched forward passes,
  and the mean number of sequences in one;
* ``powerinfer_requests_processing``, ``powerinfer_requests_deferred``: slots holding a request,
  requests waiting in the queue; ``powerinfer_slots``: slots in all.

Values are read from the scheduler when scraped (a custom collector), never copied per token.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Collector:
    def __init__(self, sched):
        self.s = sched

    def collect(self):
        s = self.s
        req = CounterMetricFamily("powerinfer_requests", "Requests ended, by outcome.", labels=["outcome"])
        for outcome, n in (("served", s.n_served), ("cancelled", s.n_cancelled), ("failed", s.n_failed)):
            req.add_metric([outcome], n)
        yield req
        yield CounterMetricFamily("powerinfer_prompt_tokens", "Prompt tokens evaluated.", value=s.n_prompt_tokens)
        yield CounterMetricFamily("powerinfer_prompt_seconds", "Seconds spent evaluating prompts.", value=s.t_prompt)
        yield GaugeMetricFamily("powerinfer_prompt_tokens_seconds", "Prompt tokens per second (all time).",
                                value=s.n_prompt_tokens / s.t_prompt if s.t_prompt > 0 else 0.0)
        yield CounterMetricFamily("powerinfer_tokens_predicted", "Tokens generated, all slots.", value=s.n_predicted)
        yield CounterMetricFamily("powerinfer_decode_seconds", "Seconds spent in decode steps.", value=s.t_decode)
        yield GaugeMetricFamily("powerinfer_predicted_tokens_seconds",
                                "Aggregate decode tokens per second over all slots (all time).",
                                value=s.n_decode_seqs / s.t_decode if s.t_decode > 0 else 0.0)
        yield CounterMetricFamily("powerinfer_decode_steps", "Batched decode forward passes.", value=s.n_decode_steps)
        yield GaugeMetricFamily("powerinfer_busy_slots_per_decode", "Mean sequences per decode step.",
                                value=s.n_decode_seqs / s.n_decode_steps if s.n_decode_steps else 0.0)
        yield GaugeMetricFamily("powerinfer_requests_processing", "Slots holding a request.", value=s.n_processing)
        yield GaugeMetricFamily("powerinfer_requests_deferred", "Requests waiting for a slot.", value=s.n_waiting)
        yield GaugeMetricFamily("powerinfer_slots", "Slots (-np).", value=s.n_slots)


def render(sched) -> tuple[bytes, str]:
    """``(body, content type)`` of the scheduler's metrics in Prometheus' text format."""
    reg = getattr(sched, "_prometheus", None)
    if reg is None:  # one registry per scheduler, made at the first scrape
        reg = sched._prometheus = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(sched))
    return generate_latest(reg), CONTENT_TYPE_LATEST
