"""lightning-elastic: runtime elastic tensor selection for PyTorch Lightning."""
