"""Datasets: the catalog (catalog.py: one entry per dataset, stdlib only), finding their files in the
data folder (locate.py), parsing them (readers.py, numpy only), downloading them (fetch.py, stdlib
only), generated data (synthetic.py), and loading, splitting and fingerprinting them (load.py, torch).

Nothing is re-exported here: import from the module that holds a name, e.g.
`from towerlab.data.load import load_dataset`.
"""
