"""The conformance kit as a pytest plugin (entry point `pytest11`, loaded wherever tokenmill is
installed): `pytest --tokenmill-plugin NAME` adds one test item per check of
`tokenmill check-plugin NAME` to the session. Without the option it does nothing.

    pytest --tokenmill-plugin myaccel                       # with the project's own tests
    pytest --tokenmill-plugin myaccel -k "not greedy_tokens"
"""
from __future__ import annotations

from typing import Any

import pytest

OPTION = "--tokenmill-plugin"


def pytest_addoption(parser: Any) -> None:
    parser.addoption(OPTION, action="append", default=[], metavar="NAME",
                     help="add tokenmill's conformance checks for this platform or attention backend (repeatable)")


class ConformanceCheck(pytest.Item):
    """One check of one plugin; its checks object is shared by the plugin's items."""

    def __init__(self, *, checks: Any, check: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checks, self.check = checks, check

    def runtest(self) -> None:
        from .check_plugin import Skip
        try:
            detail = self.checks.checks()[self.check]()
        except Skip as exc:
            pytest.skip(str(exc))
        self.user_properties.append(("detail", detail))

    def reportinfo(self) -> tuple[str, None, str]:
        return "tokenmill-check-plugin", None, self.name


@pytest.hookimpl(tryfirst=True)   # before -k / -m deselect, so they apply to these items too
def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    names = config.getoption(OPTION)
    if not names:
        return
    from .check_plugin import PluginChecks
    for name in names:
        checks = PluginChecks(name)
        for check in checks.checks():
            items.append(ConformanceCheck.from_parent(session, name=f"check_plugin[{name}]::{check}",
                                                      checks=checks, check=check))
