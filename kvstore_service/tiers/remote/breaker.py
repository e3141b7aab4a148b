"""The remote tier's circuit breaker: a store that keeps failing is not asked for a while."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

# -- the circuit breaker -------------------------------------------------------------------------

class Breaker:
    """closed -> (``failures`` failed calls in a row) -> open for ``open_s`` -> half-open: one probe call
    -> closed on success, open again on failure. A probe that never reports is replaced after ``open_s``."""

    def __init__(self, failures: int, open_s: float) -> None:
        self.failures, self.open_s = max(1, failures), open_s
        self.state = "closed"
        self.opens = 0
        self._failed = 0
        self._until = 0.0  # open: until then; half-open: the probe's deadline

    def blocked(self) -> bool:
        """Whether the store is not to be asked now (open, not yet due for a probe)."""
        return self.state == "open" and time.monotonic() < self._until

    def allow(self) -> bool:
        """Whether a call may go to the store now; in an open breaker past its time, the caller probes."""
        if self.state == "closed":
            return True
        now = time.monotonic()
        if now < self._until:
            return False
        self.state, self._until = "half-open", now + self.open_s
        return True

    def success(self) -> None:
        if self.state != "closed":
            log.info("remote store answers again: breaker closed")
        self.state, self._failed = "closed", 0

    def failure(self, error: BaseException | None) -> None:
        self._failed += 1
        if self.state == "half-open" or (self.state == "closed" and self._failed >= self.failures):
            if self.state == "closed":
                self.opens += 1
                log.warning("remote store failing (%s): breaker open for %.1f s", error, self.open_s)
            self.state, self._until = "open", time.monotonic() + self.open_s

