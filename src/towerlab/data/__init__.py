"""Datasets: finding their files in the data folder (locate.py), parsing them (readers.py, numpy only),
downloading them (fetch.py, stdlib only), generated data (synthetic.py), image folders and their cache
(folder_files.py, folder_decode.py, folder_cache.py, folders.py), loading and splitting them (load.py,
torch), and what identifies one: the digest of its arrays (digest.py). Their catalog is
towerlab.catalog.datasets.

Nothing is re-exported here: import from the module that holds a name, e.g.
`from towerlab.data.load import load_dataset`.
"""
