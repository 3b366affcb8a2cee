"""More than one node, launched as users launch them: torchrun on each "node" (here 2 processes on this machine,
the rendezvous on the loopback address) and Lightning's `trainer.num_nodes`, no launcher of our own. A sharded run
over 2 nodes × 1 process takes the steps recorded for the same run over 2 processes on one node
(tests/recorded/tiny_arith_fsdp.json, which the fast tier's `test_fsdp.py` compares with one process), step for step
and in what it did to the weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, fast_overrides, free_port, sharded_run_config, sharded_run_overrides
from golden import assert_matches, observe, recorded

pytestmark = pytest.mark.long  # a sharded run on 2 nodes: about a minute


def _two_nodes(args: list[str], root: Path) -> None:
    """`cli.py fit <args>` on 2 nodes of 1 process, each started by its own torchrun (static rendezvous at node 0's
    address), as a SLURM script starts one torchrun per node (README)."""
    port = free_port()
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    root.mkdir(parents=True, exist_ok=True)
    nodes = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "cli.py",
                   "fit", *args, "--trainer.num_nodes", "2", "--trainer.devices", "1"]
        with open(root / f"node{node}.log", "w") as out:
            nodes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    for node, process in enumerate(nodes):
        assert process.wait(timeout=600) == 0, (root / f"node{node}.log").read_text()[-3000:]


# FSDP: every forward, backward and weight gather of a step is a collective over both nodes.
def test_two_nodes_through_torchrun_take_the_recorded_steps_of_one_node(tiny_arith_model, tmp_path):
    config = sharded_run_config("tiny_arith_fsdp.yaml", tmp_path / "tiny_arith_fsdp.yaml")
    root = tmp_path / "two"
    _two_nodes(["--config", config, *fast_overrides(tiny_arith_model, root, 3), *sharded_run_overrides(root, 3)], root)
    assert_matches("two_nodes", observe(root, tiny_arith_model, root / "out"), recorded("tiny_arith_fsdp"))
