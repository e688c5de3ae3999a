"""What a store's searches look like from outside: `towerlab search show` (`show`: text, CSV and JSON
records) and `towerlab search export` (`export`: Optuna studies). Import from the module."""
