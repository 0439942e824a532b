"""Errors a user can cause and fix. The CLI prints them without a traceback and exits with 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input (config, data, environment) with a message that names the fix."""

    exit_code = 2


class ConfigError(UserError):
    """One or more config problems, all collected before reporting."""

    def __init__(self, problems: list[str], header: str = "invalid config"):
        self.problems = list(problems)
        lines = [f"{header} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))
