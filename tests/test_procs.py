"""Process trees stopped and killed at one instant (``tidal.exec.procs``: a lost machine in the Ray
tests and demos, ``tidal.demo.node_loss``), on a real shell that forks a child every 10 ms."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from plane_proc import wait_until
from tidal.exec import procs


def test_a_forking_tree_is_frozen_whole_thawed_and_killed_whole():
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & while :; do sleep 0.01; done"],
                          start_new_session=True)
    try:
        wait_until("the shell and its children", lambda: len(procs.descendants([sh.pid])) >= 4, 10)
        frozen = procs.freeze([sh.pid])
        assert sh.pid in frozen and len(frozen) >= 3  # the shell, its two sleeps, perhaps the loop's
        # "D": the shell waiting on a vforked child that was stopped before its exec
        states = {p: procs.state(p) for p in frozen}
        assert "T" in states.values() and set(states.values()) <= {"T", "D"}, states
        time.sleep(0.1)  # stopped dead: nothing new forks
        assert procs.descendants([sh.pid]) == set(frozen)

        procs.thaw(frozen)
        wait_until("the loop forking again", lambda: procs.descendants([sh.pid]) - set(frozen), 10)

        tree = procs.freeze([sh.pid])
        assert procs.kill_all(tree) == []
        assert not [p for p in tree if procs.alive(p)]
        assert procs.descendants([sh.pid]) == set()
    finally:
        if sh.poll() is None:
            os.killpg(sh.pid, signal.SIGKILL)
        sh.wait(10)
