"""A search job and its workers (import from the module): the job (`job`: evolve, grid, search run),
where its folder and store are (`place`), what it shows and writes (`record`), its workers (`workers`)
and what they must share to join a search (`identity`), and where a worker's time goes (`worker_times`)."""
