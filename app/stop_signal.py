"""How the split placement's supervisor tells its children to stop.

A stop may reach every process of the server at once: systemd's default (`KillMode=
control-group`) sends SIGTERM to each process of the service's cgroup, children included (a
terminal's Ctrl-C does not: the children have process groups of their own). A child that
took such a signal and then the supervisor's own would count two signals, and skip its drain
as an operator who signals twice asks. So the children leave SIGTERM and SIGINT to the
supervisor and stop on its word alone: SUPERVISOR_STOP, which it sends once per stop signal
it gets, and which a child also gets when the supervisor dies.
"""

from __future__ import annotations

import signal

# Sent by the supervisor only: a front end drains on the first and exits at once on the
# second; an engine finishes its queue and exits.
SUPERVISOR_STOP = signal.SIGUSR1
# What an operator, an orchestrator or a terminal sends, and the supervisor passes on.
OUTSIDE_STOPS = (signal.SIGTERM, signal.SIGINT)


def leave_stops_to_the_supervisor() -> None:
    """In a child: a stop signal sent to it directly changes nothing; the supervisor's, sent
    to it as SUPERVISOR_STOP, stops it."""
    for sig in OUTSIDE_STOPS:
        signal.signal(sig, signal.SIG_IGN)
