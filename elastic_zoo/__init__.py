"""Models, data sets and a LightningModule for the recipes and benchmarks.

The library (`lightning_elastic`) needs none of this and never imports it: it works on any LightningModule.
The zoo holds the offline-loadable transfer-learning setups that the recipes and benchmarks use; it ships
in the same distribution, and its third-party needs are the `zoo` extra (`pip install 'lightning-elastic[zoo]'`).
"""
