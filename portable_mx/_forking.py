"""State a child made by ``os.fork`` must not take over from its parent's other threads.

A fork copies the whole process but only the thread that called it. A lock another
thread held at that moment stays held in the child for good (the child's first use of it
waits forever: an interpreted kernel in a DataLoader worker forked while another thread
ran one hung), and a count or patch that thread would have undone when it finished
stays as it was (torch's fp32 matmul precision kept at "highest" in the child). Each
module with such state renews it in the child with :func:`in_child`.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["in_child"]


def in_child(renew: Callable[[], None]) -> Callable[[], None]:
    """Run ``renew`` in every child process ``os.fork`` makes from now on (where the
    platform forks); returns it (a decorator). ``renew`` runs in the child's only thread,
    before the fork returns there: it must not take a lock the parent's threads use."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=renew)
    return renew
