"""specdec loadtest's arithmetic: percentiles and the report of a set of requests."""

from specdec.tools.loadtest import RequestRecord, percentile, summarise


def test_percentiles_by_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([], 50) == 0.0 and percentile([7.0], 99) == 7.0


def test_the_report_counts_only_successful_tokens_and_errors_by_code():
    records = [RequestRecord(tokens=10, first_token_s=0.1, token_gaps_s=[0.01] * 9, total_s=0.2),
               RequestRecord(tokens=20, first_token_s=0.3, token_gaps_s=[0.02] * 19, total_s=0.7),
               RequestRecord(tokens=3, error="UNAVAILABLE", total_s=0.1)]
    report = summarise(records, sessions=2, wall_s=1.0)
    assert report.tokens == 30 and report.tokens_per_second == 30.0 and report.requests == 3
    assert report.errors == {"UNAVAILABLE": 1} and report.requests_per_second == 3.0
    assert report.ttft_p50_s == 0.1 and report.ttft_p99_s == 0.3
    assert report.itl_p50_s == 0.02 and report.itl_p99_s == 0.02
