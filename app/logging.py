"""Structured JSON-lines logs and the KV audit trail.

Log records carry ids, tenant names, sizes and timings; prompt and completion text appear only
when the operator sets ``MTPSERVE_LOG_TEXT`` (debugging). Extra fields go in ``extra={"fields":
{...}}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

AUDIT_LOGGER = "mtpserve.audit"
REQUEST_LOGGER = "mtpserve.request"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            # Type only: exception messages may quote input.
            line["exc_type"] = record.exc_info[0].__name__
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # paths hold session ids


def log_event(logger_name: str, event: str, **fields: Any) -> None:
    logging.getLogger(logger_name).info(event, extra={"fields": fields})


def audit_zero_events(events: Sequence[Any]) -> None:
    """One audit line per zeroing event: who, which session/request, how much. No text."""
    for ev in events:
        log_event(
            AUDIT_LOGGER,
            "kv_zeroed",
            audit_time=time.time(),
            tenant=getattr(ev, "owner", ""),
            request_id=getattr(ev, "request_id", None),
            session=getattr(ev, "session_id", None),
            blocks=count_blocks(getattr(ev, "blocks", 0)),
            bytes_zeroed=int(getattr(ev, "bytes", 0)),
        )


def count_blocks(blocks: Any) -> int:
    """``ZeroEvent.blocks`` may be a count or the list of block ids."""
    return len(blocks) if isinstance(blocks, list | tuple | set | frozenset) else int(blocks)
