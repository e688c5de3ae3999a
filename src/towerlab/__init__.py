"""towerlab: synchronous data-parallel ConvNet training and genetic network search."""

__version__ = "0.1.0"
