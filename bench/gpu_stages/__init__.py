"""The stages of the one-shot GPU check (`python -m bench.gpu_check`, bench/gpu_check.py), each in a module of its
own: a function `(plan, progress) -> dict` of the stage's name, which reports what it measured (and hands partial
results to `progress` as it goes), or raises `StageSkipped` saying why it cannot run here. `plan.Plan` says what each
one runs on a GPU and in the CPU dry run.
"""
