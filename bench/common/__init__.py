"""What every benchmark family shares: `machine` (what it ran on, and how busy the machine was),
`measure` (one timed `towerlab train` sample, sides alternated in rounds, medians and ratios) and `record`
(the records' folder, the command a record names, and the one writer of every JSON file a benchmark keeps)."""
