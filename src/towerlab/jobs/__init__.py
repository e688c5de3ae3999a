"""towerlab's jobs: what every job shares (`common`: folder, lock, provenance, data, restarts,
starting the processes), the train job (`train`), the search job (`search`), the bridge from a
search's genome to a training (`candidate`), and a saved model at work (`scoring`)."""
