"""gateway.logsafe on its own: what clients send is escaped and capped in log lines, our
tracebacks are left alone, and the hub command installs it on its log handler."""

from __future__ import annotations

import ast
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import logsafe
from gateway.logsafe import MAX_VALUE, SafeFilter, escape


class Lines(logging.Handler):
    """Formatted lines, as a stream handler would write them (one record may hold several)."""

    def __init__(self, fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter(fmt))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # as logging.StreamHandler does
            self.handleError(record)


@pytest.fixture
def safe_log() -> Iterator[tuple[logging.Logger, Lines]]:
    logger = logging.getLogger("test.logsafe")
    handler = Lines()
    logsafe.install(handler)
    logger.addHandler(handler)
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    logger.propagate = old_propagate


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain text, é and 中", "plain text, é and 中"),
        ("a\x1bb\x85c", "a\\x1bb\\x85c"),
        ("one\ntwo\rthree\tfour", "one\\ntwo\\rthree\\tfour"),
        ("\x00\x07\x7f\x9b", "\\x00\\x07\\x7f\\x9b"),
        ("line\u2028para\u2029rtl\u202e", "line\\u2028para\\u2029rtl\\u202e"),
        ("tag\U000e0041", "tag\\U000e0041"),
        ("back\\slash", "back\\slash"),
    ],
)
def test_escape_shows_every_non_printable_character(raw: str, shown: str) -> None:
    assert escape(raw) == shown
    assert escape(shown) == shown  # escaping twice changes nothing


def test_a_client_value_is_escaped_and_capped_in_the_line(
    safe_log: tuple[logging.Logger, Lines],
) -> None:
    logger, handler = safe_log
    logger.info("session %s/%s opened chat job %s", "key", "a\x1bb\x85c", "job1")
    logger.info("session %s/%s opened chat job %s", "key", "x" * 10_000, "job2")
    logger.warning("header %r from %s", b"\x1b[31mred\r\nforged", ("127.0.0.1", 4242))
    first, second, third = handler.lines
    assert first == "INFO test.logsafe: session key/a\\x1bb\\x85c opened chat job job1"
    assert second.startswith("INFO test.logsafe: session key/" + "x" * MAX_VALUE + "…(10000 chars)")
    assert second.endswith(" opened chat job job2") and len(second) < 400
    assert "\x1b" not in third and "\r" not in third and "\n" not in third
    assert "forged" in third and "('127.0.0.1', 4242)" in third


def test_numbers_keep_their_formats_and_mappings_work(
    safe_log: tuple[logging.Logger, Lines],
) -> None:
    logger, handler = safe_log
    logger.info("%d turns, %.1f s, %x, %s", 3, 2.25, 255, None)
    logger.info("%(who)s said %(what)r", {"who": "bob\n", "what": "hi\x1b"})
    assert handler.lines == ["INFO test.logsafe: 3 turns, 2.2 s, ff, None"] + [
        "INFO test.logsafe: bob\\n said 'hi\\x1b'"
    ]


def test_the_whole_message_is_capped_and_our_own_text_escaped(
    safe_log: tuple[logging.Logger, Lines],
) -> None:
    logger, handler = safe_log
    logger.info("y" * 50_000)
    logger.info("two\nlines of our own")
    assert len(handler.lines[0]) < logsafe.MAX_MESSAGE + 100
    assert handler.lines[0].endswith("…(50000 chars)")
    assert handler.lines[1] == "INFO test.logsafe: two\\nlines of our own"


def test_a_traceback_is_left_alone(safe_log: tuple[logging.Logger, Lines]) -> None:
    logger, handler = safe_log
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logger.exception("failed on %s", "a\x85b")
    (line,) = handler.lines
    message, _, traceback = line.partition("\n")
    assert message == "ERROR test.logsafe: failed on a\\x85b"
    assert traceback.startswith("Traceback (most recent call last):")
    assert traceback.endswith("ValueError: boom\nsecond line")


def test_two_handlers_escape_once() -> None:
    logger = logging.getLogger("test.logsafe.twice")
    handlers = [Lines("%(message)s"), Lines("%(message)s")]
    for handler in handlers:
        logsafe.install(handler)
        logsafe.install(handler)  # once per handler, however often installed
        assert sum(isinstance(f, SafeFilter) for f in handler.filters) == 1
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        logger.info("%s", "a\x1b")
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
    assert [h.lines for h in handlers] == [["a\\x1b"], ["a\\x1b"]]


def test_logsafe_is_pure() -> None:
    """The standard library only: usable by tests and any tool without an event loop."""
    tree = ast.parse(Path(logsafe.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_hub_command_installs_it_on_its_log_handler() -> None:
    from gateway.hub.cli import configure_logging

    root = logging.getLogger()
    server = logging.getLogger("gateway.wire.server")
    saved = (root.handlers[:], root.level, server.level)
    root.handlers[:] = []
    try:
        configure_logging()
        handlers = root.handlers[:]
    finally:
        root.handlers[:], level, server_level = saved
        root.setLevel(level)
        server.setLevel(server_level)
    assert handlers and all(any(isinstance(f, SafeFilter) for f in h.filters) for h in handlers)


def test_the_hub_logs_in_the_runners_format(capsys: pytest.CaptureFixture[str]) -> None:
    """One line format for the hub and the runner: ``gateway.observe``'s (not basicConfig's)."""
    from gateway.hub.cli import configure_logging
    from gateway.observe import setup_logging

    root = logging.getLogger()
    server = logging.getLogger("gateway.wire.server")
    saved = (root.handlers[:], root.level, server.level)
    root.handlers[:] = []
    try:
        configure_logging()  # the hub's, on stderr (captured)
        logging.getLogger("gateway.hub").info("from the hub \x1b[31m")
        setup_logging("INFO", "text")  # the runner's
        logging.getLogger("gateway.runner").info("from the runner")
    finally:
        root.handlers[:], level, server_level = saved
        root.setLevel(level)
        server.setLevel(server_level)
    hub_line, runner_line = capsys.readouterr().err.splitlines()
    shape = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ INFO    from the (hub|runner)"
    assert re.fullmatch(shape + r" \\x1b\[31m", hub_line), hub_line  # logsafe escaped it
    assert re.fullmatch(shape, runner_line), runner_line
