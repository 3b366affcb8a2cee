"""The CPU kernels every test runs with, set before torch is imported (conftest.py imports this first; runs the tests
start in processes of their own inherit it).

The recorded numbers (tests/golden.py) were taken with torch's and oneDNN's AVX2 kernels. The machines this project
runs on differ: some have AVX-512 with bf16 instructions, whose kernels round bf16 products otherwise (a recorded bf16
step's gradient norm moved by 1%, beyond any tolerance that would still catch a change to the step). So the tests
hold both libraries to AVX2 on every machine; set the variables yourself to run them with others."""

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
