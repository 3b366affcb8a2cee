"""More than one node, launched as users launch them: torchrun on each "node" (here 2 processes on this machine,
the rendezvous on the loopback address) and Lightning's `trainer.num_nodes`, no launcher of our own. A run over
2 nodes × 1 process equals the same run over 2 processes on one node, bit for bit: FSDP with a vLLM engine per
rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, ROOT, fast_overrides, free_port

pytestmark = pytest.mark.long  # 2 nodes against 1, with an engine per rank: about 2 minutes

# Each rank's engine (under FSDP) computes on a core of its own.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _two_nodes(args: list[str], root: Path) -> None:
    """`cli.py fit <args>` on 2 nodes of 1 process, each started by its own torchrun (static rendezvous at node 0's
    address), as a SLURM script starts one torchrun per node (README)."""
    port = free_port()
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **ENV}
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


# FSDP with an engine per rank (DDP ran here too: the same launch, torchrun per node and trainer.num_nodes, with less
# on it; DDP's equality with one process is the fast tier's).
@pytest.mark.parametrize("config", ["tiny_arith_fsdp_vllm.yaml"])
def test_two_nodes_through_torchrun_equal_two_processes_on_one_node(run_cli, tiny_arith_model, tmp_path, config):
    extra = ["--model.export_dir"]
    run_cli(CONFIGS / config, *extra, str(tmp_path / "one" / "out"), root=tmp_path / "one", subprocess=True,
            env=ENV)
    args = ["--config", str(CONFIGS / config), *fast_overrides(tiny_arith_model, tmp_path / "two", 2), *extra,
            str(tmp_path / "two" / "out")]
    _two_nodes(args, tmp_path / "two")
    one, two = (load_file(tmp_path / run / "out" / "model.safetensors") for run in ("one", "two"))
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert any(not torch.equal(one[name], start[name]) for name in one)  # the runs trained
    assert sorted(one) == sorted(two)
    for name in one:
        assert torch.equal(one[name], two[name]), name
