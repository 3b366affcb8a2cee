"""A launched server dies with the trainer that launched it (`die_with_parent`): its whole process group (vLLM's API
process, engine core and workers) is killed once the trainer is gone, even by SIGKILL. Here a stand-in server that
leads its own group, with a child of its own, under a stand-in trainer that is SIGKILLed."""

import os
import signal
import subprocess
import sys
import time

SERVER = """
import os, subprocess, sys, time
from lightning_logra.rollout.server.command import die_with_parent
die_with_parent(int(sys.argv[1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in its group, as vLLM's core is
print(os.getpid(), child.pid, flush=True)
time.sleep(60)
"""

TRAINER = """
import os, subprocess, sys
server = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], start_new_session=True,
                          stdout=subprocess.PIPE, text=True)
print(server.stdout.readline().strip(), flush=True)
import time; time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped by init) is gone too
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launched_servers_group_is_killed_once_its_trainer_is_killed():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, SERVER], stdout=subprocess.PIPE, text=True)
    server, child = map(int, trainer.stdout.readline().split())
    assert _alive(server) and _alive(child)
    trainer.kill()  # SIGKILL: nothing of the trainer's runs after it
    trainer.wait()
    deadline = time.monotonic() + 10
    while (_alive(server) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server) and not _alive(child)


def test_while_the_trainer_lives_the_server_does():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, SERVER], stdout=subprocess.PIPE, text=True)
    try:
        server, child = map(int, trainer.stdout.readline().split())
        time.sleep(1.5)
        assert _alive(server) and _alive(child)
    finally:
        trainer.kill()
        trainer.wait()
        for pid in (server, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
