"""Models, data sets and a LightningModule for the recipes and benchmarks.

The core library (`lightning_elastic`) needs none of this: it works on any LightningModule. The zoo holds
the offline-loadable transfer-learning setups that the recipes, benchmarks and tests use.
"""
