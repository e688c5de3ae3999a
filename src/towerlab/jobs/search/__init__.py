"""A search job and its workers (import from the module): the job (`job`: evolve, grid, search run),
where its folder is and its store opened (`place`), what it shows and writes (`record`), its workers
(`workers`: one crew for `search run` and `search worker`), towerlab's training as their objective
(`training`), what they must share to train a search and the one function that admits them
(`identity`), and the seam through which a benchmark measures where a worker's time goes (`worker_times`)."""
