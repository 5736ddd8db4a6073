"""One request at a time over an Engine's store: requests from other threads wait their
turn, first come first served; the thread that holds the Engine may start a newer request,
which takes over (its older stream is interrupted: waiting for it there would never end)."""
from __future__ import annotations

import threading
from collections import deque


class RequestGate:
    def __init__(self):
        self._cond = threading.Condition()
        self._holder: tuple[int, int] | None = None     # (thread id, ticket)
        self._waiting: deque[int] = deque()
        self._issued = 0

    def enter(self) -> int:
        """A ticket for the caller's request, once it holds the Engine."""
        me = threading.get_ident()
        with self._cond:
            self._issued += 1
            ticket = self._issued
            if self._holder is not None and self._holder[0] == me:
                self._holder = (me, ticket)              # a newer request of this thread
                return ticket
            self._waiting.append(ticket)
            try:
                while self._holder is not None or self._waiting[0] != ticket:
                    self._cond.wait()
            except BaseException:                        # (KeyboardInterrupt): out of the
                self._waiting.remove(ticket)             # line, or those behind wait forever
                self._cond.notify_all()
                raise
            self._waiting.popleft()
            self._holder = (me, ticket)
            self._cond.notify_all()                      # the next in line rechecks
            return ticket

    def holds(self, ticket: int) -> bool:
        holder = self._holder
        return holder is not None and holder[1] == ticket

    def leave(self, ticket: int) -> None:
        """The request ended (finished, failed, closed or dropped); an interrupted one's
        ticket no longer holds anything."""
        with self._cond:
            if self.holds(ticket):
                self._holder = None
                self._cond.notify_all()
