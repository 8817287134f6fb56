"""Log set-up: today's text lines, or one JSON object per line for log shippers."""

from __future__ import annotations

import json
import logging
import sys
import time

# Fields a log call may add with `extra=`; the JSON format writes each one present.
REQUEST_FIELDS = ("request_id", "op", "client", "outcome")


class JsonFormatter(logging.Formatter):
    """One object per line: time (UTC, ISO 8601), level, logger, message, the request
    fields present, and the traceback of an exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in REQUEST_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """Send every log line to stderr, as text or as JSON."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
