"""What proving what runs costs (towerlab.proof, towerlab.data.digest): a file of yours and its neighbours
(`objective_proof.py`), a dataset's digest (`data_digest.py`), a search worker's start before and after
(`worker_start.py`)."""
