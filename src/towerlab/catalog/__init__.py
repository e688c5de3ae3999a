"""The catalogs: what datasets (datasets.py) and models (models.py, with the values their options
take: model_options.py) exist, as data. Standard library only and nothing of towerlab's but errors,
so that config.py (the --dataset and --model choices), the command line's help and the search core
read them without numpy or torch. Nothing is re-exported here: import from the module.
"""
