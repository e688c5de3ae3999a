"""towerlab's jobs: what every job shares (`folder`: its output folder and lock; `provenance`: its
config.json; `job`: its launch and restarts; `handover`: its data, loaded once and handed to every
process), the train job (`train`, `train_resume`), the search job and its workers (the package
`search`), the bridge from a search's genome to a training (`candidate`), and a saved model at work
(`scoring`)."""
