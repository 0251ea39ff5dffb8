"""A Gloo group whose peer is frozen (SIGSTOP): a timed ``wait`` raises close to its timeout.

Rank 1 is a process of its own, so that it can be stopped for real; rank 0 is this
test's thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch

from collective.groups.gloo.group import GlooGroup
from collective.rendezvous.store import TCPRendezvousStore
from collective.types import AllReduceOptions, CollectiveTimeoutError
from tests.test_gloo_group import GROUP_TIMEOUT, _master_store

_PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from collective.groups.gloo.group import GlooGroup
from collective.rendezvous.store import TCPRendezvousStore
port, name = int(sys.argv[1]), sys.argv[2]
client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=20))
group = GlooGroup(2, 1, name, TCPRendezvousStore(client), timedelta(seconds=20))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_a_timed_wait_raises_soon_after_its_timeout_while_the_peer_is_frozen() -> None:
    master = _master_store()
    name = f"frozen-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER, str(master.port), name],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    built: list[GlooGroup] = []
    joiner = threading.Thread(
        target=lambda: built.append(
            GlooGroup(2, 0, name, TCPRendezvousStore(master), GROUP_TIMEOUT)
        ),
        daemon=True,
    )
    try:
        joiner.start()
        assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
        joiner.join(30)
        group = built[0]
        os.kill(peer.pid, signal.SIGSTOP)
        work = group.allreduce([torch.ones(4)], AllReduceOptions(async_op=True))
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as raised:
            work.wait(timedelta(seconds=0.3))
        waited = time.monotonic() - started
        group.destroy_group()
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)
    assert "allreduce" in str(raised.value) and "rank 0" in str(raised.value)
    assert waited < 1.2, f"wait(0.3 s) raised after {waited:.2f} s"
