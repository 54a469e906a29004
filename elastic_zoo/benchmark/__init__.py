"""The benchmark of `recipes/benchmark.py`: elastic selection against full fine-tuning and the usual baselines.

`methods` reads and checks what `cfg.benchmark` asks for, `measure` runs one method in a fresh process and
records its figures, `report` turns the runs into `results.csv` and `results.md` (`cells`: a figure over seeds,
`verdicts`: the issue's targets and the wall-clock contract, `paired`: differences paired by seed), and `plots` draws
them.
"""
