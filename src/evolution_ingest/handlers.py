"""The built-in handlers, by the names ``EVOLUTION_INGEST_HANDLERS`` takes.

``evolution_ingest.handlers:log_summary`` (the default), ``:log_with_text`` (the operator's
opt-in to logging message text) and ``:noop`` (keep the inbox only; benchmarks).
"""

from evolution_ingest.logic.handlers import log_summary, log_with_text, message_text, noop, summarize

__all__ = ["log_summary", "log_with_text", "message_text", "noop", "summarize"]
