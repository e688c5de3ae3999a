"""towerlab's jobs: what every job shares (`folder`: its output folder and lock; `provenance`: its
config.json; `job`: its launch and restarts; `handover`: its data, loaded once and handed to every
process), the train job (`train`, `train_resume`), the search job and its workers (the package
`search`; what trains a search's tasks is `towerlab.objective`'s), and a saved model at work
(`scoring`)."""
