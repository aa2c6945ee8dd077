"""Fields a request sent that change nothing (`ignored_fields`: undeclared ones, and those its
model declares so), answered as vLLM's server answers them: accepted and ignored. Each is
counted (`sluice_ignored_fields_total{api, field}`) and logged, once an app by its name: a
warning naming the field and the endpoint, for an operator to see what clients send in vain."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from server.observability.metrics import Metrics

logger = logging.getLogger("sluice.server")
# Undeclared names are the clients' to choose: past this many, new ones are counted only.
LOGGED_NAMES = 1000


@dataclass(slots=True)
class IgnoredFields:
    """The app's record of ignored fields: counted in `metrics`, each name logged once."""

    metrics: Metrics
    logged: set[str] = field(default_factory=set)

    def note(
        self, api: str, endpoint: str, fields: Sequence[str], declared: Collection[str] = ()
    ) -> None:
        """Count `fields` (a request's ignored fields, by their paths) for `api`, and log each
        name not logged yet (with the closest of the body's `declared` fields, for a name that
        is not one: a misspelt field is ignored too)."""
        if not fields:
            return
        self.metrics.count_ignored(api, fields)
        for name in fields:
            if name in self.logged or len(self.logged) > LOGGED_NAMES:
                continue
            self.logged.add(name)
            if len(self.logged) > LOGGED_NAMES:
                logger.warning(
                    "ignored fields: %d names logged, new ones are counted only", LOGGED_NAMES
                )
                return
            close = (
                difflib.get_close_matches(name, declared, n=1)
                if "." not in name and name not in declared
                else []
            )
            logger.warning(
                "ignored the field '%s' of %s%s: it changes nothing this server answers, as "
                "vLLM's server ignores it (logged once a process; counted in "
                "sluice_ignored_fields_total)",
                name,
                endpoint,
                f" (did you mean '{close[0]}'?)" if close else "",
            )
