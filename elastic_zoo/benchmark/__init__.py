"""The benchmark of `recipes/benchmark.py`: elastic selection against full fine-tuning and the usual baselines.

`methods` reads and checks what `cfg.benchmark` asks for, `measure` runs one method in a fresh process and
records its figures, `report` turns the runs into `results.csv` and `results.md`, and `plots` draws them.
"""
