"""Log lines: each event loop turn's lines go out in one write, stamped and redacted, and none is lost or cut."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import orjson
import pytest

from evolution_ingest.logs import Lines, _Handler, _Stamp, redact


class Out(io.BytesIO):
    """A binary file that counts the writes it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


async def next_turn() -> None:
    """Until the loop has run what was scheduled so far: the write of this turn's lines among it."""
    loop = asyncio.get_running_loop()
    turned = loop.create_future()
    loop.call_soon(turned.set_result, None)
    await turned


def log(lines: Lines, line: bytes) -> None:
    """What structlog does with a rendered line: ``Lines`` is its logger."""
    lines.info(line)


async def test_the_lines_of_a_loop_turn_go_out_together_at_the_next_turn() -> None:
    out = Out()
    lines = Lines(out)
    for i in range(5):
        log(lines, b"line %d" % i)
    assert out.getvalue() == b""
    await next_turn()
    assert out.getvalue() == b"line 0\nline 1\nline 2\nline 3\nline 4\n"
    assert out.writes == 1

    log(lines, b"the next turn")
    await next_turn()
    assert out.getvalue().endswith(b"line 4\nthe next turn\n")
    assert out.writes == 2


def test_a_line_logged_where_no_loop_runs_goes_out_at_once() -> None:
    out = Out()
    lines = Lines(out)
    log(lines, b"at start-up")
    assert out.getvalue() == b"at start-up\n"


async def test_lines_beyond_the_most_that_wait_go_out_at_once() -> None:
    out = Out()
    lines = Lines(out, most=3)
    log(lines, b"1")
    log(lines, b"2")
    assert out.getvalue() == b""
    log(lines, b"3")
    assert out.getvalue() == b"1\n2\n3\n"
    await next_turn()  # the write scheduled for the turn finds nothing left
    assert out.writes == 1


async def test_a_line_from_another_thread_goes_out_at_once_and_in_one_piece() -> None:
    out = Out()
    lines = Lines(out)
    log(lines, b"on the loop")
    thread = threading.Thread(target=log, args=(lines, b"from a thread"))
    thread.start()
    thread.join()
    # The thread wrote what was waiting too, in order: a line is never held behind a turn
    # that another thread's write has already emptied.
    assert out.getvalue() == b"on the loop\nfrom a thread\n"
    await next_turn()
    assert out.writes == 1


async def test_standard_library_records_join_the_same_lines_in_order() -> None:
    out = Out()
    lines = Lines(out)
    handler = _Handler(lines)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    record = logging.LogRecord("aiormq", logging.WARNING, __file__, 1, "connection lost", None, None)
    log(lines, b"ours")
    handler.emit(record)
    log(lines, b"ours again")
    await next_turn()
    assert out.getvalue() == b"ours\naiormq: connection lost\nours again\n"


async def test_a_closed_stderr_costs_the_line_not_the_caller() -> None:
    out = Out()
    lines = Lines(out)
    out.close()
    log(lines, b"nowhere to go")
    await next_turn()  # the scheduled write meets a closed file and says nothing
    lines.write_out()


SCRIPT = """
import asyncio, logging, threading
import structlog
from evolution_ingest import logs
from evolution_ingest.config import LogFormat

logs.configure("INFO", LogFormat.JSON)
log = structlog.get_logger("t")
log.info("start-up")

async def turn(start):  # the lines of one loop turn
    for i in range(start, start + 100):
        log.info("outcome", i=i, token="not-a-real-token")

async def main():
    for start in range(0, 1000, 100):
        await asyncio.create_task(turn(start))
    thread = threading.Thread(target=log.info, args=("from a thread",))
    thread.start(); thread.join()
    logging.getLogger("aiormq").warning("a library's line")

asyncio.run(main())

# A line whose loop stops before its next turn is written at exit.
loop = asyncio.new_event_loop()
def last():
    log.info("the loop's last line")
    loop.stop()
loop.call_soon(last)
loop.run_forever()
loop.close()
"""


def test_a_process_writes_every_line_whole_and_the_last_ones_at_exit() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60, check=True)
    lines = [orjson.loads(line) for line in done.stderr.splitlines()]
    events = [line["event"] for line in lines]
    assert events[0] == "start-up"
    assert [line["i"] for line in lines if line["event"] == "outcome"] == list(range(1000))
    assert {"from a thread", "a library's line"} <= set(events)
    assert events[-1] == "the loop's last line"
    assert all(line.get("token") in (None, "[redacted]") for line in lines)
    assert b"not-a-real-token" not in done.stderr


def test_a_line_is_stamped_in_utc_to_the_microsecond_and_the_second_is_made_anew() -> None:
    stamp = _Stamp()
    line = stamp(None, "info", {})["timestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", line), line
    assert abs(datetime.fromisoformat(line.replace("Z", "+00:00")) - datetime.now(UTC)).total_seconds() < 5


def test_the_stamp_of_the_next_second_is_not_the_last_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    stamp, now = _Stamp(), iter([1_000_000_000.5, 1_000_000_000.75, 1_000_000_001.25, 1_000_086_400.0])
    monkeypatch.setattr(time, "time", lambda: next(now))
    assert [stamp(None, "info", {})["timestamp"] for _ in range(4)] == [
        "2001-09-09T01:46:40.500000Z",
        "2001-09-09T01:46:40.750000Z",
        "2001-09-09T01:46:41.250000Z",
        "2001-09-10T01:46:40.000000Z",
    ]


def test_secret_looking_keys_are_redacted_whatever_their_case() -> None:
    line = redact(None, "info", {"Authorization": "Bearer x", "apiKey": "k", "instance": "sales"})
    assert line == {"Authorization": "[redacted]", "apiKey": "[redacted]", "instance": "sales"}
