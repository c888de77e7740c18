"""The errors that end a run with status 2 and no traceback: a user's mistake, every problem found listed."""
from __future__ import annotations

from typing import Sequence


class UserError(Exception):
    """A user mistake (config, data, model files); carries every problem found. Ends the run with status 2."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(UserError):
    """A problem in the options."""
