"""HTTP helpers for tests of the metrics endpoint: GETs and parsed scrapes."""

from __future__ import annotations

import http.client

from prometheus_client.parser import text_string_to_metric_families


def get(port: int, path: str, timeout: float = 30.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics body: (name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = get(port, "/metrics")
    assert status == 200, body
    return samples(body)


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)
