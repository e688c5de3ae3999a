"""A search job and its workers (import from the module): the job (`job`: evolve, grid, search run),
where its folder is and its store opened (`place`), what it shows and writes (`record`, and whether a
search of your objective stops on its first results: `first_results`), its workers (`workers`: one crew for
`search run` and `search worker`, each search's tasks trained by the objective its command names, of any
kind: `towerlab.objective`), and the seam through which a benchmark measures where a worker's time goes
(`worker_times`)."""
