"""Skips the run cannot hide: every skip is listed with its reason (``-rs``), and under CI
(``CI=true``) a skip not in ``EXPECTED_SKIPS`` fails the run, so a broken install (an extra that
did not install, turning ``importorskip`` into silent skips) fails CI instead of a user."""

import os

import pytest

EXPECTED_SKIPS: dict[str, str] = {}
"""Test id -> why it may skip under CI. Empty: the test extra installs everything CI runs."""


def _unexpected(terminalreporter) -> list:
    return [report for report in terminalreporter.stats.get("skipped", []) if report.nodeid not in EXPECTED_SKIPS]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if os.environ.get("CI") == "true" and _unexpected(terminalreporter):
        terminalreporter.section("skips CI does not expect", sep="=", red=True)
        for report in _unexpected(terminalreporter):
            terminalreporter.line(
                f"{report.nodeid}: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr}"
            )
        terminalreporter.line(
            "a skip under CI is a missing install step or a broken environment: fix it, or list the test in "
            "tests/conftest.py's EXPECTED_SKIPS with the reason"
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get("CI") == "true" and reporter is not None and _unexpected(reporter) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
